/* The original Qwen's qwen.tiktoken, turned into the tokenizer.json tree that
 * the byte-level BPE loader (tokenizer.c) already reads, so encoding runs on
 * the same tables, caches and split matcher as Qwen2's files.
 *
 * The file: one token a line, "BASE64 RANK", ranks 0..N-1 each once. tiktoken
 * encodes a pre-tokenizer piece by starting from its bytes and merging, again
 * and again, the adjacent pair whose concatenation has the lowest rank (the
 * leftmost on a tie) while any concatenation is a token. A BPE whose merges
 * are every (a, b) with a, b and ab all tokens, ranked by the rank of ab, makes
 * exactly those choices: its candidate pairs are the adjacent pairs whose
 * concatenation is a token, its order is that token's rank, and two pairs
 * that make the same token at once are equal strings, where both pick the
 * leftmost. That is how transformers converts a tiktoken vocabulary
 * (convert_slow_tokenizer's TikTokenConverter); the merges here are listed
 * by the made token's rank, then by the left part's length.
 *
 * Around the BPE, as Qwen's tokenization_qwen.py runs it: NFC (it calls
 * unicodedata.normalize("NFC", text) first), Qwen's split pattern (PAT_STR,
 * the same regex as Qwen2's tokenizer.json), and the special tokens after the
 * N ranks: <|endoftext|>, <|im_start|>, <|im_end|>, <|extra_0|> ..
 * <|extra_204|> (ids 151643 .. 151850 for the real file), matched anywhere in
 * the text (its allowed_special="all"). */
#include "text/bpe_impl.h"

#include "core/error.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TIKTOKEN_EXTRAS 205 /* <|extra_0|> .. <|extra_204|> */

typedef struct {
    const uint8_t *p; /* into the decoded-bytes arena */
    uint32_t n;
} tk_tok;

/* bytes -> rank, open addressing; rank -1 empty */
typedef struct {
    int32_t *slot;
    size_t mask;
    const tk_tok *tok;
} tk_map;

static size_t tk_hash(const uint8_t *p, size_t n) { return (size_t)bpe_hash_bytes(p, n) * 0x9E3779B97F4A7C15ull; }

static int32_t tk_find(const tk_map *m, const uint8_t *p, size_t n) {
    for (size_t i = tk_hash(p, n) & m->mask;; i = (i + 1) & m->mask) {
        int32_t r = m->slot[i];
        if (r < 0) return -1;
        if (m->tok[r].n == n && !memcmp(m->tok[r].p, p, n)) return r;
    }
}

static int b64_val(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with padding; returns the byte count, or -1. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4) return -1;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        for (int k = 0; k < 4; k++) v[k] = s[i + k] == '=' && i + 4 == n && k >= 2 ? -2 : b64_val((unsigned char)s[i + k]);
        if (v[0] < 0 || v[1] < 0 || v[2] == -1 || v[3] == -1 || (v[2] == -2 && v[3] != -2)) return -1;
        out[o++] = (uint8_t)(v[0] << 2 | v[1] >> 4);
        if (v[2] >= 0) out[o++] = (uint8_t)((v[1] & 15) << 4 | v[2] >> 2);
        if (v[3] >= 0) out[o++] = (uint8_t)((v[2] & 3) << 6 | v[3]);
    }
    return (long)o;
}

size_t bpe_spell_bytes(const uint8_t *p, size_t n, const uint32_t byte_to_cp[256], char *out) {
    char *o = out;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = byte_to_cp[p[i]];
        if (cp < 0x80) *o++ = (char)cp;
        else *o++ = (char)(0xC0 | cp >> 6), *o++ = (char)(0x80 | (cp & 0x3F)); /* all below U+0800 */
    }
    *o = 0;
    return (size_t)(o - out);
}

/* Reads the lines into tok[rank] (bytes in *arena); *n the count. */
static int parse_lines(const char *path, const char *buf, size_t len, tk_tok **tok_out, uint8_t **arena_out,
                       int32_t *n_out) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += buf[i] == '\n';
    if (len && buf[len - 1] != '\n') lines++;
    if (lines < 256 || lines >= (size_t)(1 << BPE_ID_BITS) - TIKTOKEN_EXTRAS - 3)
        return QT_ERR(QT_EFORMAT, "%s: %zu lines; a qwen.tiktoken has one \"BASE64 RANK\" line per token, at least the 256 bytes", path, lines);
    tk_tok *tok = qt_calloc(lines, sizeof *tok, "tiktoken ranks");
    uint8_t *arena = qt_malloc(len + 1, "tiktoken bytes"); /* decoded is shorter than the text */
    if (!tok || !arena) {
        qt_free(tok), qt_free(arena);
        return QT_ENOMEM;
    }
    size_t ao = 0, line = 0;
    int rc = QT_OK;
    for (size_t i = 0; i < len && rc == QT_OK; line++) {
        size_t e = i;
        while (e < len && buf[e] != '\n') e++;
        const char *s = buf + i, *sp = memchr(s, ' ', e - i);
        char *end = NULL;
        long r = sp ? strtol(sp + 1, &end, 10) : -1;
        long nb = sp ? b64_decode(s, (size_t)(sp - s), arena + ao) : -1;
        if (!sp || nb <= 0 || end != buf + e || r < 0 || (size_t)r >= lines || sp + 1 == buf + e)
            rc = QT_ERR(QT_EFORMAT, "%s:%zu: expected \"BASE64 RANK\" with a rank from 0 to %zu; the file is damaged",
                        path, line + 1, lines - 1);
        else if (tok[r].p)
            rc = QT_ERR(QT_EFORMAT, "%s:%zu: rank %ld appears twice; the file is damaged", path, line + 1, r);
        else {
            tok[r].p = arena + ao, tok[r].n = (uint32_t)nb;
            ao += (size_t)nb;
        }
        i = e + 1;
    }
    if (rc != QT_OK) {
        qt_free(tok), qt_free(arena);
        return rc;
    }
    *tok_out = tok, *arena_out = arena, *n_out = (int32_t)lines;
    return QT_OK;
}

static cJSON *obj_with_type(const char *type) {
    cJSON *o = cJSON_CreateObject();
    if (o && !cJSON_AddStringToObject(o, "type", type)) cJSON_Delete(o), o = NULL;
    return o;
}

/* The two tokens llama.cpp's convert_hf_to_gguf.py (QwenModel.bpe) merges into
 * token r: its bytes merged by tiktoken's rule with the ranks below r only, which
 * stops at two parts for every token of a well-formed file. *cut: the left
 * part's length; 0 when it does not end in two parts. */
static int converter_split(const tk_tok *t, int32_t r, const tk_map *map, uint32_t *cut) {
    uint32_t *end = qt_malloc((size_t)t->n * sizeof *end, "tiktoken split"); /* end[i]: end of part i */
    if (!end) return QT_ENOMEM;
    uint32_t parts = t->n;
    for (uint32_t i = 0; i < parts; i++) end[i] = i + 1;
    for (;;) {
        int32_t best = -1;
        uint32_t at = 0;
        for (uint32_t i = 0; i + 1 < parts; i++) {
            uint32_t b = i ? end[i - 1] : 0;
            int32_t k = tk_find(map, t->p + b, end[i + 1] - b);
            if (k >= 0 && k < r && (best < 0 || k < best)) best = k, at = i;
        }
        if (best < 0) break;
        memmove(end + at, end + at + 1, (size_t)(parts - at - 1) * sizeof *end);
        parts--;
    }
    *cut = parts == 2 ? end[0] : 0;
    qt_free(end);
    return QT_OK;
}

static int build_tree(const char *path, const tk_tok *tok, int32_t n, const tk_map *map,
                      const uint32_t byte_to_cp[256], int converter_merges, cJSON **out) {
    cJSON *root = cJSON_CreateObject(), *model = obj_with_type("BPE"), *vocab = cJSON_CreateObject(),
          *merges = cJSON_CreateArray(), *added = cJSON_CreateArray();
    int ok = root && model && vocab && merges && added;
    if (ok) cJSON_AddItemToObject(model, "vocab", vocab), vocab = NULL;
    if (ok) cJSON_AddItemToObject(model, "merges", merges);
    if (ok) cJSON_AddItemToObject(root, "model", model), model = NULL;
    if (ok) cJSON_AddItemToObject(root, "added_tokens", added), added = NULL;
    cJSON_Delete(model), cJSON_Delete(vocab), cJSON_Delete(added);
    size_t maxlen = 0;
    for (int32_t r = 0; r < n; r++) maxlen = tok[r].n > maxlen ? tok[r].n : maxlen;
    char *s = qt_malloc(4 * maxlen + 8, "tiktoken token string"), *m = qt_malloc(4 * maxlen + 8, "tiktoken merge");
    int rc = ok && s && m ? QT_OK : QT_ENOMEM;
    cJSON *vocab_node = rc == QT_OK ? cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "model"), "vocab") : NULL;
    for (int32_t r = 0; r < n && rc == QT_OK; r++) {
        bpe_spell_bytes(tok[r].p, tok[r].n, byte_to_cp, s);
        if (!cJSON_AddNumberToObject(vocab_node, s, r)) rc = QT_ENOMEM;
        /* every split of the token into two tokens is a merge of this rank; or, for
         * converter_merges, the one split llama.cpp's converter writes */
        uint32_t only = 0;
        if (converter_merges && tok[r].n > 1 && (rc = converter_split(&tok[r], r, map, &only)) == QT_OK && !only)
            rc = QT_ERR(QT_EFORMAT, "%s: rank %d is not two lower-ranked tokens merged, so it has no BPE merge; the "
                        "file is not a tiktoken BPE vocabulary", path, r);
        for (uint32_t i = 1; i < tok[r].n && rc == QT_OK; i++) {
            if (converter_merges && i != only) continue;
            if (tk_find(map, tok[r].p, i) < 0 || tk_find(map, tok[r].p + i, tok[r].n - i) < 0) continue;
            size_t k = bpe_spell_bytes(tok[r].p, i, byte_to_cp, m);
            m[k++] = ' ';
            bpe_spell_bytes(tok[r].p + i, tok[r].n - i, byte_to_cp, m + k);
            cJSON *e = cJSON_CreateString(m);
            if (!e || !cJSON_AddItemToArray(merges, e)) rc = QT_ENOMEM;
        }
    }
    /* tokenization_qwen.py's SPECIAL_TOKENS, numbered from the end of the ranks */
    cJSON *add = rc == QT_OK ? cJSON_GetObjectItemCaseSensitive(root, "added_tokens") : NULL;
    for (int i = 0; i < 3 + TIKTOKEN_EXTRAS && rc == QT_OK; i++) {
        char name[32];
        if (i < 3) snprintf(name, sizeof name, "%s", (const char *[]){"<|endoftext|>", "<|im_start|>", "<|im_end|>"}[i]);
        else snprintf(name, sizeof name, "<|extra_%d|>", i - 3);
        cJSON *a = cJSON_CreateObject();
        if (!a || !cJSON_AddNumberToObject(a, "id", n + i) || !cJSON_AddStringToObject(a, "content", name) ||
            !cJSON_AddTrueToObject(a, "special") || !cJSON_AddFalseToObject(a, "normalized") ||
            !cJSON_AddItemToArray(add, a))
            rc = QT_ENOMEM;
    }
    /* NFC, Qwen's split pattern, ByteLevel; the ByteLevel decoder */
    cJSON *norm = obj_with_type("NFC"), *pre = obj_with_type("Sequence"), *list = cJSON_CreateArray(),
          *split = obj_with_type("Split"), *pat = cJSON_CreateObject(), *bl = obj_with_type("ByteLevel"),
          *dec = obj_with_type("ByteLevel");
    if (rc == QT_OK && norm && pre && list && split && pat && bl && dec && cJSON_AddStringToObject(pat, "Regex", bpe_qwen_pattern) &&
        cJSON_AddStringToObject(split, "behavior", "Isolated") && cJSON_AddFalseToObject(split, "invert") &&
        cJSON_AddFalseToObject(bl, "add_prefix_space") && cJSON_AddFalseToObject(bl, "use_regex")) {
        cJSON_AddItemToObject(split, "pattern", pat);
        cJSON_AddItemToArray(list, split);
        cJSON_AddItemToArray(list, bl);
        cJSON_AddItemToObject(pre, "pretokenizers", list);
        cJSON_AddItemToObject(root, "normalizer", norm);
        cJSON_AddItemToObject(root, "pre_tokenizer", pre);
        cJSON_AddItemToObject(root, "decoder", dec);
    } else {
        cJSON_Delete(norm), cJSON_Delete(pre), cJSON_Delete(list), cJSON_Delete(split), cJSON_Delete(pat);
        cJSON_Delete(bl), cJSON_Delete(dec);
        if (rc == QT_OK) rc = QT_ENOMEM;
    }
    qt_free(s), qt_free(m);
    if (rc != QT_OK) {
        cJSON_Delete(root);
        return rc == QT_ENOMEM ? QT_ERR(QT_ENOMEM, "%s: out of memory building the tokenizer tables", path) : rc;
    }
    *out = root;
    return QT_OK;
}

int bpe_tiktoken_tree(const char *path, const char *buf, size_t len, const uint32_t byte_to_cp[256],
                      int converter_merges, cJSON **out) {
    *out = NULL;
    tk_tok *tok = NULL;
    uint8_t *arena = NULL;
    int32_t n = 0;
    QT_TRY(parse_lines(path, buf, len, &tok, &arena, &n));
    tk_map map = {.tok = tok};
    size_t cap = 1;
    while (cap < (size_t)n * 2) cap <<= 1;
    map.mask = cap - 1;
    map.slot = qt_malloc(cap * sizeof *map.slot, "tiktoken lookup");
    int rc = map.slot ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) {
        memset(map.slot, 0xFF, cap * sizeof *map.slot);
        for (int32_t r = 0; r < n && rc == QT_OK; r++) {
            if (tk_find(&map, tok[r].p, tok[r].n) >= 0) {
                rc = QT_ERR(QT_EFORMAT, "%s: rank %d repeats the bytes of an earlier rank; the file is damaged", path, r);
                break;
            }
            size_t i = tk_hash(tok[r].p, tok[r].n) & map.mask;
            while (map.slot[i] >= 0) i = (i + 1) & map.mask;
            map.slot[i] = r;
        }
    }
    for (int b = 0; b < 256 && rc == QT_OK; b++) {
        uint8_t c = (uint8_t)b;
        if (tk_find(&map, &c, 1) < 0)
            rc = QT_ERR(QT_EFORMAT, "%s has no token for byte 0x%02X; a byte-level BPE needs all 256", path, b);
    }
    if (rc == QT_OK) rc = build_tree(path, tok, n, &map, byte_to_cp, converter_merges, out);
    qt_free(map.slot);
    qt_free(tok);
    qt_free(arena);
    return rc;
}
