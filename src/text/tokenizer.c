/* Loading a Hugging Face tokenizer.json into the tables the encoder runs on,
 * and the ByteLevel decoder. The encoder itself is bpe_encode.c/bpe_merge.c.
 *
 * Every token is kept twice: as tokenizer.json spells it (the ByteLevel
 * alphabet, "Ġthe") for bpe_id_token/bpe_token_id, and as the raw bytes it
 * stands for (" the"), which is what the encoder and decoder work on. */
#include "text/bpe_impl.h"
#include "text/chat.h"
#include "text/utf8.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdlib.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <string.h>

#define BPE_MAX_FILE (1024ull << 20) /* a tokenizer.json past 1 GiB is not one */
#define BPE_MAX_ID (1 << BPE_ID_BITS) /* ids are packed in 20 bits; this also bounds every table sized by ids */

/* GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other
 * 68 (controls, space, 0x7F..0xA0, 0xAD) map to U+0100.. in byte order. */
static void byte_level_tables(uint32_t byte_to_cp[256], int16_t cp_to_byte[324]) {
    int n = 0;
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        byte_to_cp[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

/* ---- loading ---- */

typedef struct {
    const char *path;
    cJSON *root;
    uint32_t byte_to_cp[256];
    int16_t cp_to_byte[324];
} load_ctx;

static int set_token(bpe_tokenizer *t, load_ctx *c, int32_t id, const char *s, const char *where) {
    if (id < 0 || id >= t->n_ids)
        return QT_ERR(QT_EFORMAT, "%s: %s has id %d, outside 0..%d; the file is damaged", c->path, where, id, t->n_ids - 1);
    t->tok_str[id] = (char *)s; /* points into the JSON tree until copied */
    return QT_OK;
}

static int parse_ids(bpe_tokenizer *t, load_ctx *c, const cJSON *vocab, const cJSON *added) {
    int64_t max_id = -1;
    size_t n_vocab = 0;
    for (const cJSON *e = vocab->child; e; e = e->next, n_vocab++) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= BPE_MAX_ID || e->valuedouble != (int32_t)e->valuedouble)
            return QT_ERR(QT_EFORMAT, "%s: model.vocab entry \"%s\" has no valid id (a whole number 0..%d); the file is damaged",
                          c->path, e->string ? e->string : "?", BPE_MAX_ID - 1);
        if (e->valueint > max_id) max_id = e->valueint;
    }
    for (const cJSON *a = added ? added->child : NULL; a; a = a->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(a, "content");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= BPE_MAX_ID ||
            id->valuedouble != (int32_t)id->valuedouble || !cJSON_IsString(content) ||
            !content->valuestring[0])
            return QT_ERR(QT_EFORMAT, "%s: an added_tokens entry lacks a valid \"id\" or a non-empty \"content\"", c->path);
        if (id->valueint > max_id) max_id = id->valueint;
    }
    if (n_vocab < 256) return QT_ERR(QT_EFORMAT, "%s: model.vocab has %zu tokens; a byte-level BPE needs at least the 256 byte tokens", c->path, n_vocab);
    t->n_ids = (int32_t)(max_id + 1);
    t->tok_str = qt_calloc((size_t)t->n_ids, sizeof *t->tok_str, "token strings");
    t->is_added = qt_calloc((size_t)t->n_ids, 1, "added-token flags");
    if (!t->tok_str || !t->is_added) return QT_ENOMEM;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        if (t->tok_str[e->valueint])
            return QT_ERR(QT_EFORMAT, "%s: model.vocab gives id %d to both \"%s\" and \"%s\"", c->path, e->valueint,
                          t->tok_str[e->valueint], e->string);
        QT_TRY(set_token(t, c, e->valueint, e->string, "a vocab token"));
    }
    for (const cJSON *a = added ? added->child : NULL; a; a = a->next) {
        int32_t id = cJSON_GetObjectItemCaseSensitive(a, "id")->valueint;
        QT_TRY(set_token(t, c, id, cJSON_GetObjectItemCaseSensitive(a, "content")->valuestring, "an added token"));
        t->is_added[id] = 1;
    }
    return QT_OK;
}

/* Copies the token strings out of the JSON tree and decodes each to bytes. */
static int build_strings(bpe_tokenizer *t, load_ctx *c) {
    size_t total = 0;
    for (int32_t i = 0; i < t->n_ids; i++)
        if (t->tok_str[i]) total += strlen(t->tok_str[i]) + 1;
    t->str_arena = qt_malloc(total ? total : 1, "token strings");
    t->bytes = qt_malloc(total ? total : 1, "token bytes"); /* decoded never longer than the string */
    t->tok_off = qt_malloc(((size_t)t->n_ids + 1) * sizeof *t->tok_off, "token offsets");
    t->str_len = qt_calloc((size_t)t->n_ids, sizeof *t->str_len, "token string lengths");
    t->id_byte = qt_calloc((size_t)t->n_ids, 1, "byte tokens");
    t->id_is_byte = qt_calloc((size_t)t->n_ids, 1, "byte tokens");
    if (!t->str_arena || !t->bytes || !t->tok_off || !t->str_len || !t->id_byte || !t->id_is_byte) return QT_ENOMEM;
    if (total > UINT32_MAX) return QT_ERR(QT_EFORMAT, "%s: the vocabulary's strings exceed 4 GiB", c->path);
    size_t so = 0, bo = 0;
    for (int32_t i = 0; i < t->n_ids; i++) {
        t->tok_off[i] = (uint32_t)bo;
        const char *s = t->tok_str[i];
        if (!s) continue;
        size_t n = strlen(s);
        memcpy(t->str_arena + so, s, n + 1);
        t->tok_str[i] = t->str_arena + so;
        t->str_len[i] = (uint32_t)n;
        so += n + 1;
        /* HF's ByteLevel decoder: every char mapped back to its byte, or, if
         * any char is outside the byte alphabet, the token's own UTF-8. */
        size_t start = bo;
        int all = utf8_valid_prefix(s, n) == n;
        for (size_t j = 0; all && j < n;) {
            int l;
            uint32_t cp = utf8_decode((const uint8_t *)s + j, &l);
            if (cp >= 324 || c->cp_to_byte[cp] < 0) { all = 0; break; }
            t->bytes[bo++] = (uint8_t)c->cp_to_byte[cp];
            j += (size_t)l;
        }
        if (!all) {
            bo = start;
            memcpy(t->bytes + bo, s, n);
            bo += n;
        }
    }
    t->tok_off[t->n_ids] = (uint32_t)bo;
    memcpy(t->byte_cp, c->byte_to_cp, sizeof t->byte_cp);
    for (int32_t i = 0; i < t->n_ids; i++)
        if (!t->is_added[i] && t->tok_off[i + 1] - t->tok_off[i] > t->max_word_bytes)
            t->max_word_bytes = t->tok_off[i + 1] - t->tok_off[i];
    t->str_cap = bpe_pow2_at_least((size_t)t->n_ids * 2);
    t->str_tab = qt_malloc(t->str_cap * sizeof *t->str_tab, "token lookup table");
    if (!t->str_tab) return QT_ENOMEM;
    for (size_t i = 0; i < t->str_cap; i++) t->str_tab[i].id = -1;
    for (int32_t i = 0; i < t->n_ids; i++)
        if (t->tok_str[i] && !t->is_added[i]) bpe_str_insert(t, t->tok_str[i], i);
    for (int32_t i = 0; i < t->n_ids; i++)
        if (t->tok_str[i] && t->is_added[i]) bpe_str_insert(t, t->tok_str[i], i);
    for (int b = 0; b < 256; b++) {
        char u[5];
        int l = utf8_encode(c->byte_to_cp[b], u);
        t->byte_id[b] = bpe_str_find(t, u, (size_t)l);
        if (t->byte_id[b] < 0)
            return QT_ERR(QT_EUNSUPPORTED, "%s: model.vocab has no token for byte 0x%02X; qtune reads byte-level BPE vocabularies (GPT-2/Qwen style) only",
                          c->path, b);
        t->id_byte[t->byte_id[b]] = (uint8_t)b;
        t->id_is_byte[t->byte_id[b]] = 1;
    }
    return QT_OK;
}

static int add_merge(bpe_tokenizer *t, load_ctx *c, size_t rank, const char *a, size_t na, const char *b, size_t nb) {
    int32_t ia = bpe_str_find(t, a, na), ib = bpe_str_find(t, b, nb);
    char buf[1024];
    if (ia < 0 || ib < 0 || na + nb >= sizeof buf)
        return QT_ERR(QT_EFORMAT, "%s: model.merges[%zu] (\"%.*s %.*s\") names a token that model.vocab lacks", c->path, rank,
                      (int)na, a, (int)nb, b);
    memcpy(buf, a, na);
    memcpy(buf + na, b, nb);
    int32_t id = bpe_str_find(t, buf, na + nb);
    if (id < 0)
        return QT_ERR(QT_EFORMAT, "%s: model.merges[%zu] (\"%.*s %.*s\") makes \"%.*s\", which model.vocab lacks", c->path, rank,
                      (int)na, a, (int)nb, b, (int)(na + nb), buf);
    t->merge_id[rank] = id;
    uint64_t key = ((uint64_t)(uint32_t)ia << BPE_ID_BITS) | (uint32_t)ib;
    size_t mask = t->merge_cap - 1;
    for (size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> t->merge_shift);; i = (i + 1) & mask) {
        uint64_t s = t->merges[i];
        if (s == UINT64_MAX || (s & BPE_KEY_MASK) == key) { /* a repeated pair: the later rank wins, as in HF */
            t->merges[i] = ((uint64_t)rank << (2 * BPE_ID_BITS)) | key;
            break;
        }
    }
    if (t->id_is_byte[ia] && t->id_is_byte[ib]) t->byte_pair[t->id_byte[ia] * 256 + t->id_byte[ib]] = (uint32_t)rank;
    return QT_OK;
}

static int parse_merges(bpe_tokenizer *t, load_ctx *c, const cJSON *merges) {
    size_t n = (size_t)cJSON_GetArraySize(merges);
    if (n > BPE_MAX_RANK || t->n_ids >= (1 << BPE_ID_BITS))
        return QT_ERR(QT_EUNSUPPORTED, "%s: %zu merges over %d ids; qtune supports up to %u merges and %d ids", c->path, n, t->n_ids,
                      BPE_MAX_RANK, 1 << BPE_ID_BITS);
    t->n_merges = n;
    /* load factor about 0.6: short probes, 2 MiB for Qwen's 151k merges */
    t->merge_cap = bpe_pow2_at_least(n + n / 2 + 2);
    int lg = 0;
    while (((size_t)1 << lg) < t->merge_cap) lg++;
    t->merge_shift = 64 - lg;
    t->merges = qt_malloc(t->merge_cap * sizeof *t->merges, "BPE merge table");
    t->merge_id = qt_malloc((n ? n : 1) * sizeof *t->merge_id, "BPE merge ids");
    t->byte_pair = qt_malloc(256 * 256 * sizeof *t->byte_pair, "BPE byte-pair table");
    if (!t->merges || !t->merge_id || !t->byte_pair) return QT_ENOMEM;
    memset(t->merges, 0xFF, t->merge_cap * sizeof *t->merges);
    memset(t->byte_pair, 0xFF, 256 * 256 * sizeof *t->byte_pair);
    size_t rank = 0;
    for (const cJSON *m = merges->child; m; m = m->next, rank++) {
        if (cJSON_IsString(m)) { /* older files: "a b" */
            const char *s = m->valuestring, *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' '))
                return QT_ERR(QT_EFORMAT, "%s: model.merges[%zu] is \"%s\"; expected two tokens separated by one space", c->path, rank, s);
            QT_TRY(add_merge(t, c, rank, s, (size_t)(sp - s), sp + 1, strlen(sp + 1)));
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) && cJSON_IsString(m->child->next)) {
            const char *a = m->child->valuestring, *b = m->child->next->valuestring;
            QT_TRY(add_merge(t, c, rank, a, strlen(a), b, strlen(b)));
        } else {
            return QT_ERR(QT_EFORMAT, "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", c->path, rank);
        }
    }
    return QT_OK;
}

static int cmp_added(const void *a, const void *b) {
    const bpe_added *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id - y->id;
}

static int flag(const cJSON *o, const char *k, int dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

static int parse_added(bpe_tokenizer *t, load_ctx *c, const cJSON *added) {
    t->added_one_first = -1;
    t->n_added = added ? (size_t)cJSON_GetArraySize(added) : 0;
    if (!t->n_added) return QT_OK;
    t->added = qt_calloc(t->n_added, sizeof *t->added, "added tokens");
    if (!t->added) return QT_ENOMEM;
    size_t i = 0;
    for (const cJSON *a = added->child; a; a = a->next, i++) {
        bpe_added *d = &t->added[i];
        d->id = cJSON_GetObjectItemCaseSensitive(a, "id")->valueint;
        d->content = t->tok_str[d->id];
        d->len = strlen(d->content);
        d->special = flag(a, "special", 0);
        d->lstrip = flag(a, "lstrip", 0);
        d->rstrip = flag(a, "rstrip", 0);
        d->single_word = flag(a, "single_word", 0);
        d->normalized = flag(a, "normalized", !d->special);
        t->added_first[(uint8_t)d->content[0]] = 1;
    }
    qsort(t->added, t->n_added, sizeof *t->added, cmp_added);
    t->added_one_first = (uint8_t)t->added[0].content[0];
    for (size_t k = 1; k < t->n_added; k++)
        if ((uint8_t)t->added[k].content[0] != t->added_one_first) t->added_one_first = -1;
    return QT_OK;
}

static int parse_normalizer(bpe_tokenizer *t, load_ctx *c) {
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(c->root, "normalizer");
    if (!n || cJSON_IsNull(n)) return QT_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(n, "type");
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "NFC")) {
        t->nfc = 1;
        return QT_OK;
    }
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers");
        for (const cJSON *e = list ? list->child : NULL; e; e = e->next) {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(e, "type");
            if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "NFC"))
                return QT_ERR(QT_EUNSUPPORTED, "%s: normalizer \"%s\" is not supported; qtune runs NFC or no normalizer",
                              c->path, cJSON_IsString(ty) ? ty->valuestring : "?");
            t->nfc = 1;
        }
        return QT_OK;
    }
    return QT_ERR(QT_EUNSUPPORTED, "%s: normalizer \"%s\" is not supported; qtune runs NFC or no normalizer", c->path,
                  cJSON_IsString(type) ? type->valuestring : "?");
}

/* HF compiles the Split regex with Oniguruma, whose \s (Unicode) also matches
 * U+0085 (NEL); PCRE2's \s under UCP does not. Everything else the Qwen
 * patterns use means the same in both, so \s is widened here and the rest of
 * the pattern passes through untouched. */
static int onig_compatible(const char *pat, char **out) {
    size_t n = strlen(pat);
    char *o = qt_malloc(n * 12 + 1, "split regex");
    if (!o) return QT_ENOMEM;
    size_t j = 0;
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = pat[i];
        if (ch == '\\' && i + 1 < n) {
            char e = pat[i + 1];
            if (e == 's') {
                const char *r = in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
                memcpy(o + j, r, strlen(r));
                j += strlen(r);
            } else if (e == 'S' && !in_class) {
                memcpy(o + j, "[^\\s\\x{85}]", 11);
                j += 11;
            } else {
                o[j++] = ch;
                o[j++] = e;
            }
            i++;
            continue;
        }
        if (ch == '[' && !in_class) {
            in_class = 1;
            o[j++] = ch;
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < n && pat[i + 1] == '^') o[j++] = pat[++i];
            if (i + 1 < n && pat[i + 1] == ']') o[j++] = pat[++i];
            continue;
        }
        if (ch == ']' && in_class) in_class = 0;
        o[j++] = ch;
    }
    o[j] = 0;
    *out = o;
    return QT_OK;
}

static int compile_regex(bpe_tokenizer *t, load_ctx *c, const char *pattern) {
    char *pat;
    QT_TRY(onig_compatible(pattern, &pat));
    int err;
    PCRE2_SIZE erroff;
    t->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &erroff, NULL);
    if (t->re) t->re_anchored = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &err, &erroff, NULL);
    qt_free(pat);
    if (!t->re || !t->re_anchored) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return QT_ERR(QT_EFORMAT, "%s: the pre_tokenizer's Split regex does not compile (%s, near offset %zu)", c->path,
                      (char *)msg, (size_t)erroff);
    }
    t->re_jit = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE) == 0 && pcre2_jit_compile(t->re_anchored, PCRE2_JIT_COMPLETE) == 0;
    if (!t->re_jit) qt_debug("PCRE2 JIT unavailable; the split regex runs interpreted (slower)");
    if (!strcmp(pattern, bpe_qwen_pattern)) return bpe_split_init(t); /* Qwen's regex: the hand-written matcher in front */
    return QT_OK;
}

static int check_byte_level(load_ctx *c, const cJSON *bl, int want_regex) {
    const cJSON *aps = cJSON_GetObjectItemCaseSensitive(bl, "add_prefix_space");
    if (cJSON_IsTrue(aps))
        return QT_ERR(QT_EUNSUPPORTED, "%s: ByteLevel add_prefix_space=true is not supported (Qwen's files have false)", c->path);
    const cJSON *ur = cJSON_GetObjectItemCaseSensitive(bl, "use_regex");
    int use = ur ? cJSON_IsTrue(ur) : 1;
    if (use != want_regex)
        return QT_ERR(QT_EUNSUPPORTED, "%s: a ByteLevel pre_tokenizer with use_regex=%s in this position is not supported", c->path,
                      use ? "true" : "false");
    return QT_OK;
}

static int parse_pre_tokenizer(bpe_tokenizer *t, load_ctx *c) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(c->root, "pre_tokenizer");
    const cJSON *type = p ? cJSON_GetObjectItemCaseSensitive(p, "type") : NULL;
    if (!cJSON_IsString(type)) return QT_ERR(QT_EUNSUPPORTED, "%s: no pre_tokenizer; qtune needs ByteLevel (optionally after Split)", c->path);
    if (!strcmp(type->valuestring, "ByteLevel")) { /* GPT-2 style: ByteLevel with its own regex */
        QT_TRY(check_byte_level(c, p, 1));
        return compile_regex(t, c, "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
    }
    if (strcmp(type->valuestring, "Sequence"))
        return QT_ERR(QT_EUNSUPPORTED, "%s: pre_tokenizer \"%s\" is not supported; qtune runs Split + ByteLevel", c->path, type->valuestring);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
    const cJSON *split = list ? list->child : NULL, *bl = split ? split->next : NULL;
    const cJSON *st = split ? cJSON_GetObjectItemCaseSensitive(split, "type") : NULL;
    const cJSON *bt = bl ? cJSON_GetObjectItemCaseSensitive(bl, "type") : NULL;
    if (!cJSON_IsString(st) || strcmp(st->valuestring, "Split") || !cJSON_IsString(bt) || strcmp(bt->valuestring, "ByteLevel") || bl->next)
        return QT_ERR(QT_EUNSUPPORTED, "%s: pre_tokenizer Sequence must be [Split, ByteLevel] as in Qwen's files", c->path);
    QT_TRY(check_byte_level(c, bl, 0));
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(split, "pattern");
    const cJSON *re = pat ? cJSON_GetObjectItemCaseSensitive(pat, "Regex") : NULL;
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(split, "behavior");
    if (!cJSON_IsString(re)) return QT_ERR(QT_EUNSUPPORTED, "%s: the Split pre_tokenizer needs a {\"Regex\": ...} pattern", c->path);
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated") || cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(split, "invert")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: the Split pre_tokenizer must have behavior \"Isolated\" and invert false", c->path);
    return compile_regex(t, c, re->valuestring);
}

static int parse_model(bpe_tokenizer *t, load_ctx *c) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(c->root, "model");
    const cJSON *type = model ? cJSON_GetObjectItemCaseSensitive(model, "type") : NULL;
    if (!cJSON_IsObject(model) || (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE"))))
        return QT_ERR(QT_EUNSUPPORTED, "%s: model.type must be \"BPE\"; qtune reads byte-level BPE tokenizers", c->path);
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(model, "byte_fallback")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: model.byte_fallback=true is not supported (a SentencePiece-style BPE)", c->path);
    /* HF's BPE: with ignore_merges a word that is a vocabulary token is that token, merges or not (Llama 3's
     * tokenizers set it; bpe_word_ids) */
    const cJSON *im = cJSON_GetObjectItemCaseSensitive(model, "ignore_merges");
    if (im && !cJSON_IsNull(im) && !cJSON_IsBool(im))
        return QT_ERR(QT_EFORMAT, "%s: model.ignore_merges must be true or false", c->path);
    t->ignore_merges = cJSON_IsTrue(im);
    /* merges skipped at random: an encoder that ignored it would differ from HF's in silence */
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return QT_ERR(QT_EUNSUPPORTED, "%s: model.dropout must be null or 0 (BPE dropout makes encoding random; "
                      "Qwen's tokenizers have null)", c->path);
    const char *affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(model, affix[i]);
        if (cJSON_IsString(a) && a->valuestring[0])
            return QT_ERR(QT_EUNSUPPORTED, "%s: model.%s \"%s\" is not supported", c->path, affix[i], a->valuestring);
    }
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(c->root, "added_tokens");
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return QT_ERR(QT_EFORMAT, "%s: model.vocab (an object) or model.merges (an array) is missing", c->path);
    if (added && !cJSON_IsArray(added)) return QT_ERR(QT_EFORMAT, "%s: added_tokens must be an array", c->path);
    QT_TRY(parse_ids(t, c, vocab, added));
    QT_TRY(build_strings(t, c));
    QT_TRY(parse_merges(t, c, merges));
    return parse_added(t, c, added);
}

/* A path ending in .tiktoken (or a folder with qwen.tiktoken and no tokenizer.json): the original Qwen's. */
int bpe_is_tiktoken_file(const char *file) {
    size_t n = strlen(file);
    return n >= 9 && !strcmp(file + n - 9, ".tiktoken");
}

int bpe_folder_file(const char *dir, char *path, size_t cap) {
    static const char *const names[] = {"tokenizer.json", "qwen.tiktoken"};
    for (int i = 0; i < 2; i++)
        if (qt_path_join(path, cap, dir, names[i]) == QT_OK && qt_path_exists(path)) return 1;
    qt_error_clear();
    return 0;
}

int bpe_tiktoken_gguf_tree(const char *path, cJSON **out) {
    char *buf;
    size_t len;
    uint32_t byte_to_cp[256];
    int16_t cp_to_byte[324];
    QT_TRY(qt_read_file(path, BPE_MAX_FILE, &buf, &len));
    byte_level_tables(byte_to_cp, cp_to_byte);
    int rc = bpe_tiktoken_tree(path, buf, len, byte_to_cp, 1, out);
    qt_free(buf);
    return rc;
}

int bpe_load_vocab(const char *path, bpe_tokenizer **out, char *dir, size_t cap) {
    *out = NULL;
    char file[4096];
    if (qt_is_dir(path)) {
        QT_TRY(qt_path_join(file, sizeof file, path, "tokenizer.json"));
        if (!qt_path_exists(file)) {
            char tk[4096];
            QT_TRY(qt_path_join(tk, sizeof tk, path, "qwen.tiktoken"));
            if (qt_path_exists(tk)) memcpy(file, tk, sizeof file);
        }
    } else if (snprintf(file, sizeof file, "%s", path) >= (int)sizeof file) {
        return QT_ERR(QT_EINVAL, "tokenizer path is too long: %s", path);
    }
    if (!qt_path_exists(file))
        return QT_ERR(QT_EIO, "%s does not exist; pass a tokenizer.json (or the original Qwen's qwen.tiktoken) or the model folder that holds one", file);
    char *buf;
    size_t len;
    QT_TRY(qt_read_file(file, BPE_MAX_FILE, &buf, &len));
    load_ctx c = {.path = file};
    byte_level_tables(c.byte_to_cp, c.cp_to_byte);
    if (bpe_is_tiktoken_file(file)) {
        int rc = bpe_tiktoken_tree(file, buf, len, c.byte_to_cp, 0, &c.root);
        if (rc != QT_OK) {
            qt_free(buf);
            return rc;
        }
    } else {
        const char *end = NULL;
        c.root = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
        if (!c.root) {
            size_t at = end && end >= buf ? (size_t)(end - buf) : 0;
            qt_free(buf);
            return QT_ERR(QT_EFORMAT, "%s is not valid JSON (near byte %zu); re-download the tokenizer", file, at);
        }
        if (!end) end = buf + len; /* cJSON sets it on success; never compare a NULL */
        while (end < buf + len && isspace((unsigned char)*end)) end++;
        if (end < buf + len) {
            size_t at = (size_t)(end - buf);
            cJSON_Delete(c.root);
            qt_free(buf);
            return QT_ERR(QT_EFORMAT, "%s has text after its JSON object (at byte %zu); re-download the tokenizer", file,
                          at);
        }
    }
    bpe_tokenizer *t = qt_calloc(1, sizeof *t, "tokenizer");
    int rc = t ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) {
        t->hash = qt_hash64(buf, len, 0);
        t->tiktoken = bpe_is_tiktoken_file(file);
        rc = parse_model(t, &c);
    }
    if (rc == QT_OK) rc = parse_normalizer(t, &c);
    if (rc == QT_OK) rc = parse_pre_tokenizer(t, &c);
    if (rc == QT_OK) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(c.root, "decoder");
        const cJSON *dt = d ? cJSON_GetObjectItemCaseSensitive(d, "type") : NULL;
        if (d && !cJSON_IsNull(d) && (!cJSON_IsString(dt) || strcmp(dt->valuestring, "ByteLevel")))
            rc = QT_ERR(QT_EUNSUPPORTED, "%s: decoder \"%s\" is not supported; qtune decodes ByteLevel", file,
                        cJSON_IsString(dt) ? dt->valuestring : "?");
    }
    if (rc == QT_OK) rc = bpe_cache_init(t);
    if (rc == QT_OK) rc = bpe_span_init(t);
    cJSON_Delete(c.root);
    qt_free(buf);
#ifdef __GLIBC__
    /* The JSON tree leaves some million small chunks in glibc's fast bins;
     * the next large malloc (the first encode's buffers) would merge them
     * all (malloc_consolidate: 80 million instructions for Qwen3's file).
     * Pay that here, as part of loading, and hand the pages back. */
    malloc_trim(0);
#endif
    if (rc != QT_OK) {
        bpe_free_vocab(t);
        return rc;
    }
    qt_path_dirname(dir, cap, file); /* where the folder's chat template is, beside the tokenizer file */
    *out = t;
    return QT_OK;
}

void bpe_free_vocab(bpe_tokenizer *t) {
    if (!t) return;
    bpe_cache_free(t);
    if (t->re) pcre2_code_free(t->re);
    if (t->re_anchored) pcre2_code_free(t->re_anchored);
    qt_free(t->cp_class);
    qt_free(t->tok_str);
    qt_free(t->tok_off);
    qt_free(t->bytes);
    qt_free(t->str_arena);
    qt_free(t->str_tab);
    qt_free(t->merges);
    qt_free(t->merge_id);
    qt_free(t->byte_pair);
    qt_free(t->id_byte);
    qt_free(t->id_is_byte);
    qt_free(t->str_len);
    qt_free(t->added);
    qt_free(t->is_added);
    qt_free(t);
}

int32_t bpe_token_id(const bpe_tokenizer *t, const char *token) {
    return token ? bpe_str_find(t, token, strlen(token)) : -1;
}

const char *bpe_id_token(const bpe_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids ? t->tok_str[id] : NULL;
}

int32_t bpe_vocab_size(const bpe_tokenizer *t) { return t->n_ids; }
const char *bpe_chat_system(const bpe_tokenizer *t) {
    return t && t->tiktoken ? CHAT_QWEN1_SYSTEM : CHAT_DEFAULT_SYSTEM;
}
int bpe_is_tiktoken(const bpe_tokenizer *t) { return t && t->tiktoken; }

int bpe_is_added(const bpe_tokenizer *t, int32_t id) { return id >= 0 && id < t->n_ids && t->is_added[id]; }

int bpe_decode(const bpe_tokenizer *t, const int32_t *ids, size_t n, char **out, size_t *len) {
    *out = NULL;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids || !t->tok_str[ids[i]])
            return QT_ERR(QT_EINVAL, "token id %d (at position %zu) is not in this tokenizer's vocabulary of %d ids", ids[i], i, t->n_ids);
        total += t->tok_off[ids[i] + 1] - t->tok_off[ids[i]];
    }
    char *raw = qt_malloc(total + 1, "decoded bytes");
    if (!raw) return QT_ENOMEM;
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = t->tok_off[ids[i]], b = t->tok_off[ids[i] + 1];
        memcpy(raw + j, t->bytes + a, b - a);
        j += b - a;
    }
    raw[j] = 0;
    if (utf8_valid_prefix(raw, j) == j) {
        *out = raw;
        if (len) *len = j;
        return QT_OK;
    }
    /* String::from_utf8_lossy: each maximal ill-formed subpart -> U+FFFD. */
    size_t n2;
    int rc = utf8_sanitize(raw, j, out, &n2);
    qt_free(raw);
    if (rc == QT_OK && len) *len = n2;
    return rc;
}
