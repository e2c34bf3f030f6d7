package org.example.cache;

import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.function.Function;

/**
 * A least-recently-used cache of bounded size. Not thread-safe: callers
 * synchronize if they share one.
 */
public final class LruCache<K, V> {
    private final int capacity;
    private final LinkedHashMap<K, V> entries;
    private long hits;
    private long misses;

    public LruCache(int capacity) {
        if (capacity <= 0) {
            throw new IllegalArgumentException("capacity must be positive, got " + capacity);
        }
        this.capacity = capacity;
        this.entries = new LinkedHashMap<>(16, 0.75f, true) {
            @Override
            protected boolean removeEldestEntry(Map.Entry<K, V> eldest) {
                return size() > LruCache.this.capacity;
            }
        };
    }

    public Optional<V> get(K key) {
        Objects.requireNonNull(key, "key");
        V value = entries.get(key);
        if (value == null) {
            misses++;
            return Optional.empty();
        }
        hits++;
        return Optional.of(value);
    }

    public void put(K key, V value) {
        Objects.requireNonNull(key, "key");
        Objects.requireNonNull(value, "value");
        entries.put(key, value);
    }

    public V computeIfAbsent(K key, Function<? super K, ? extends V> loader) {
        Objects.requireNonNull(key, "key");
        Objects.requireNonNull(loader, "loader");
        V value = entries.get(key);
        if (value != null) {
            hits++;
            return value;
        }
        misses++;
        try {
            value = loader.apply(key);
        } catch (RuntimeException e) {
            throw new IllegalStateException("loading " + key + " failed", e);
        }
        if (value == null) {
            throw new IllegalStateException("loader returned null for " + key);
        }
        entries.put(key, value);
        return value;
    }

    public boolean remove(K key) {
        Objects.requireNonNull(key, "key");
        return entries.remove(key) != null;
    }

    public int size() {
        return entries.size();
    }

    public int capacity() {
        return capacity;
    }

    public double hitRate() {
        long total = hits + misses;
        return total == 0 ? 0.0 : (double) hits / total;
    }

    public void clear() {
        entries.clear();
        hits = 0;
        misses = 0;
    }
}
