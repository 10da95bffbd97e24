#include "core/words.h"

#include <ctype.h>
#include <string.h>

#define WORD_MAX 64

/* Optimal string alignment distance (Damerau-Levenshtein without repeated
 * edits of one substring), case-insensitive; words are keys, so short. */
static int distance(const char *a, const char *b) {
    size_t n = strlen(a), m = strlen(b);
    if (n >= WORD_MAX || m >= WORD_MAX) return WORD_MAX;
    int d[WORD_MAX + 1][WORD_MAX + 1];
    for (size_t i = 0; i <= n; i++) d[i][0] = (int)i;
    for (size_t j = 0; j <= m; j++) d[0][j] = (int)j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            int ca = tolower((unsigned char)a[i - 1]), cb = tolower((unsigned char)b[j - 1]);
            int v = d[i - 1][j - 1] + (ca != cb);
            if (d[i - 1][j] + 1 < v) v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && ca == tolower((unsigned char)b[j - 2]) && tolower((unsigned char)a[i - 2]) == cb &&
                d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    return d[n][m];
}

const char *qt_nearest_word(const char *word, const char *const *list) {
    size_t n = strlen(word);
    int limit = n <= 4 ? 1 : n <= 12 ? 2 : 3, best = limit + 1;
    const char *pick = NULL;
    for (; *list; list++) {
        int dd = distance(word, *list);
        if (dd == 0) return NULL;
        if (dd < best) best = dd, pick = *list;
    }
    return pick;
}
