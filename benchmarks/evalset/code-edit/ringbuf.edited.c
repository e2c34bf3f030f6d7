/* A fixed-capacity ring buffer of bytes for a UART driver. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define RINGBUF_CAPACITY 256u

typedef struct {
    uint8_t data[RINGBUF_CAPACITY];
    size_t head; /* next slot to write */
    size_t tail; /* next slot to read */
    size_t count;
} ringbuf_t;

void ringbuf_init(ringbuf_t *rb)
{
    memset(rb, 0, sizeof(*rb));
}

bool ringbuf_is_empty(const ringbuf_t *rb)
{
    return rb->count == 0;
}

bool ringbuf_is_full(const ringbuf_t *rb)
{
    return rb->count == RINGBUF_CAPACITY;
}

size_t ringbuf_free_space(const ringbuf_t *rb)
{
    return RINGBUF_CAPACITY - rb->count;
}

bool ringbuf_push(ringbuf_t *rb, uint8_t byte)
{
    if (ringbuf_is_full(rb)) {
        return false;
    }
    rb->data[rb->head] = byte;
    rb->head = (rb->head + 1) % RINGBUF_CAPACITY;
    rb->count++;
    return true;
}

bool ringbuf_pop(ringbuf_t *rb, uint8_t *out)
{
    if (ringbuf_is_empty(rb)) {
        return false;
    }
    *out = rb->data[rb->tail];
    rb->tail = (rb->tail + 1) % RINGBUF_CAPACITY;
    rb->count--;
    return true;
}

size_t ringbuf_write(ringbuf_t *rb, const uint8_t *src, size_t len)
{
    size_t written = 0;
    while (written < len && ringbuf_push(rb, src[written])) {
        written++;
    }
    return written;
}

/* Copy up to `len` bytes from the front of the buffer into `dst` without
 * removing them; returns how many were copied. */
size_t ringbuf_peek(const ringbuf_t *rb, uint8_t *dst, size_t len)
{
    size_t n = len < rb->count ? len : rb->count;
    for (size_t i = 0; i < n; i++) {
        dst[i] = rb->data[(rb->tail + i) % RINGBUF_CAPACITY];
    }
    return n;
}

size_t ringbuf_read(ringbuf_t *rb, uint8_t *dst, size_t len)
{
    size_t read = 0;
    while (read < len && ringbuf_pop(rb, &dst[read])) {
        read++;
    }
    return read;
}

void ringbuf_clear(ringbuf_t *rb)
{
    rb->head = 0;
    rb->tail = 0;
    rb->count = 0;
}
