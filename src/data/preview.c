/* The first example of a data file, rendered with its labels marked. */
#include "data/preview.h"

#include "core/error.h"
#include "core/mem.h"
#include "data/format.h"
#include "data/lines.h"
#include "text/chat_template.h"

#include <stdio.h>
#include <string.h>

int dl_preview_first(const bpe_tokenizer *tok, const char *path, const char *format, int mask_prompt, size_t max_bytes,
                     char **out) {
    *out = NULL;
    dl_format fmt = DL_FORMAT_AUTO;
    if (format) QT_TRY(dl_format_parse(format, &fmt));
    dl_lines r;
    QT_TRY(dl_lines_open(&r, path, 0));
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = mask_prompt};
    dl_tokbuf tb = {0};
    char *line;
    size_t len;
    int got, rc = QT_OK;
    while ((got = dl_lines_next(&r, &line, &len)) == 1 && dl_line_blank(line, len)) {
    }
    if (got < 0) rc = got;
    else if (got == 0) rc = QT_ERR(QT_EFORMAT, "%s holds no example", path);
    else rc = dl_encode_line_in_place(&ctx, path, (long long)r.line_no, line, len, &fmt, &tb);
    char *text = NULL;
    if (rc == QT_OK) rc = chat_show_labels(tok, tb.ids, tb.mask, tb.n, &text);
    dl_tokbuf_free(&tb);
    dl_lines_close(&r);
    if (rc != QT_OK) return rc;
    size_t n = strlen(text);
    if (n > max_bytes) { /* cut at a character boundary, and say so */
        size_t cut = max_bytes;
        while (cut && ((unsigned char)text[cut] & 0xC0) == 0x80) cut--;
        char note[96];
        int k = snprintf(note, sizeof note, "\n... (%zu more bytes not shown)", n - cut);
        memcpy(text + cut, note, (size_t)k + 1 <= n - cut ? (size_t)k + 1 : 0);
        if ((size_t)k + 1 > n - cut) text[cut] = 0;
    }
    *out = text;
    return QT_OK;
}
