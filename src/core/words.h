/* "Did you mean ...?" for misspelled keys. */
#ifndef QT_CORE_WORDS_H
#define QT_CORE_WORDS_H

/* The entry of the NULL-terminated list nearest to word in edit distance
 * (insert, delete, replace, swap of neighbours; case ignored), when that
 * distance is small for the word's length (at most 1 for up to 4 characters,
 * 2 up to 12, else 3); NULL when none is that near or word is in the list. */
const char *qt_nearest_word(const char *word, const char *const *list);

#endif
