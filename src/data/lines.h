/* A bounded line reader for JSONL files. A line longer than the cap is read
 * past (never stored) and reported as file:line, so a 1 GB line costs no more
 * memory than the cap. */
#ifndef QT_DATA_LINES_H
#define QT_DATA_LINES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DL_DEFAULT_MAX_LINE_BYTES ((size_t)64 << 20) /* 64 MiB */

typedef struct {
    FILE *f;
    const char *path;  /* borrowed, for messages */
    size_t max_line;   /* longest line accepted, in bytes, newline excluded */
    char *line;        /* (line_cap) the current line, NUL-terminated */
    size_t line_cap;
    char *in;          /* (DL_LINES_CHUNK) read buffer */
    size_t in_pos, in_len;
    int64_t line_no;   /* 1-based number of the line last returned, counted from the range start */
    uint64_t pos;      /* file offset of the next unread byte */
    uint64_t limit;    /* no line starting at or after this offset is returned */
    int eof;
} dl_lines;

int dl_lines_open(dl_lines *r, const char *path, size_t max_line);
/* Only the lines that start in [start, limit): a line that straddles `start`
 * belongs to the range before. Ranges cut anywhere partition a file's lines. */
int dl_lines_open_range(dl_lines *r, const char *path, size_t max_line, uint64_t start, uint64_t limit);
/* 1: *line and *len hold the next line (without "\n" or "\r\n"), valid until the
 * next call (the buffer is the reader's, and the caller may write in it: see
 * dl_encode_line_in_place); 0: end of file; QT_EFORMAT: the line is over the cap (it has been
 * skipped, so the caller may continue); other negative codes: I/O errors. */
int dl_lines_next(dl_lines *r, char **line, size_t *len);
/* 1 when the line holds only whitespace (isspace): readers skip it. */
int dl_line_blank(const char *s, size_t n);
void dl_lines_close(dl_lines *r);

/* A fast 64-bit content hash (8 bytes per step), for cache keys and the
 * cache's data checksum; not cryptographic. Chain calls through h. */
uint64_t dl_hash_bytes(const void *data, size_t n, uint64_t h);
/* Hash and size of a whole file, read in chunks. */
int dl_hash_file(const char *path, uint64_t *hash, uint64_t *size);

#endif
