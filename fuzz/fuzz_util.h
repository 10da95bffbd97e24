/* Harness helpers: parsers that take a path get the fuzz input through a
 * private temporary file. */
#ifndef QT_FUZZ_UTIL_H
#define QT_FUZZ_UTIL_H
#include <stddef.h>
#include <stdint.h>
/* Writes data to a per-process temporary file named with suffix; returns its path. */
const char *fuzz_write_temp(const uint8_t *data, size_t size, const char *suffix);
/* A per-process temporary folder (created once). */
const char *fuzz_temp_dir(void);
#endif
