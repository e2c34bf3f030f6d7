/* Minimal INI reader: sections, key = value pairs, ; comments. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ini_entry {
    char *section;
    char *key;
    char *value;
    struct ini_entry *next;
} ini_entry;

void ini_free(ini_entry *list);

static char *trim(char *s)
{
    char *end;
    while (isspace((unsigned char)*s)) {
        s++;
    }
    end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1])) {
        end--;
    }
    *end = '\0';
    return s;
}

static char *copy(const char *s)
{
    size_t n = strlen(s) + 1;
    char *out = malloc(n);
    if (out == NULL) {
        return NULL;
    }
    memcpy(out, s, n);
    return out;
}

ini_entry *ini_load(const char *path)
{
    char line[512];
    char section[128] = "";
    ini_entry *head = NULL;
    ini_entry **tail = &head;
    FILE *f = fopen(path, "r");

    if (f == NULL) {
        return NULL;
    }
    while (fgets(line, sizeof(line), f)) {
        char *s = trim(line);
        char *eq;
        ini_entry *e;
        if (*s == '\0' || *s == ';') {
            continue;
        }
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (close == NULL) {
                goto fail;
            }
            *close = '\0';
            snprintf(section, sizeof(section), "%s", trim(s + 1));
            continue;
        }
        eq = strchr(s, '=');
        if (eq == NULL) {
            goto fail;
        }
        *eq = '\0';
        e = calloc(1, sizeof(*e));
        if (e == NULL) {
            goto fail;
        }
        *tail = e;
        tail = &e->next;
        e->section = copy(section);
        e->key = copy(trim(s));
        e->value = copy(trim(eq + 1));
        if (e->section == NULL || e->key == NULL || e->value == NULL) {
            goto fail;
        }
    }
    fclose(f);
    return head;

fail:
    fclose(f);
    ini_free(head);
    return NULL;
}

const char *ini_get(const ini_entry *list, const char *section, const char *key)
{
    for (; list; list = list->next) {
        if (strcmp(list->section, section) == 0 && strcmp(list->key, key) == 0) {
            return list->value;
        }
    }
    return NULL;
}

void ini_free(ini_entry *list)
{
    while (list) {
        ini_entry *next = list->next;
        free(list->section);
        free(list->key);
        free(list->value);
        free(list);
        list = next;
    }
}
