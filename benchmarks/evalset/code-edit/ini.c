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

    while (fgets(line, sizeof(line), f)) {
        char *s = trim(line);
        char *eq;
        ini_entry *e;
        if (*s == '\0' || *s == ';') {
            continue;
        }
        if (*s == '[') {
            char *close = strchr(s, ']');
            *close = '\0';
            snprintf(section, sizeof(section), "%s", trim(s + 1));
            continue;
        }
        eq = strchr(s, '=');
        *eq = '\0';
        e = malloc(sizeof(*e));
        e->section = copy(section);
        e->key = copy(trim(s));
        e->value = copy(trim(eq + 1));
        e->next = NULL;
        *tail = e;
        tail = &e->next;
    }
    fclose(f);
    return head;
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
