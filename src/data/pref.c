/* Preference pairs: each side turned into a {"prompt", "completion"} object
 * and encoded by format.c's prompt_completion rules (pref.h). */
#include "data/pref.h"

#include <cjson/cJSON.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "data/format.h"

#define PREF_MAX_FILE ((size_t)4 << 30)

static const cJSON *get(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

int dl_pref_detect(const cJSON *obj) {
    return cJSON_IsObject(obj) && get(obj, "chosen") && get(obj, "rejected");
}

/* LLaMA-Factory's ShareGPT roles to the chat template's */
static const char *role_of(const char *from) {
    if (!strcmp(from, "human") || !strcmp(from, "user")) return "user";
    if (!strcmp(from, "gpt") || !strcmp(from, "assistant")) return "assistant";
    if (!strcmp(from, "system")) return "system";
    return NULL;
}

static cJSON *message(const char *role, const char *content) {
    cJSON *m = cJSON_CreateObject();
    if (m && (!cJSON_AddStringToObject(m, "role", role) || !cJSON_AddStringToObject(m, "content", content))) {
        cJSON_Delete(m);
        return NULL;
    }
    return m;
}

/* {"from", "value"} (or a string) to one message; NULL with an error set */
static cJSON *sharegpt_message(const cJSON *v, const char *key) {
    if (cJSON_IsString(v)) return message("assistant", v->valuestring);
    const cJSON *from = get(v, "from"), *value = get(v, "value");
    const char *role = cJSON_IsString(from) ? role_of(from->valuestring) : NULL;
    if (!role || !cJSON_IsString(value)) {
        QT_ERR(QT_EFORMAT, "\"%s\" must be {\"from\": \"human\"|\"gpt\"|\"system\", \"value\": \"...\"}", key);
        return NULL;
    }
    return message(role, value->valuestring);
}

/* The two {"prompt", "completion"} objects of one line (out[0] chosen, out[1] rejected). */
static int to_prompt_completion(const cJSON *obj, cJSON *out[2]) {
    const cJSON *ch = get(obj, "chosen"), *rj = get(obj, "rejected"), *conv = get(obj, "conversations");
    const cJSON *prompt = get(obj, "prompt"), *instr = get(obj, "instruction");
    out[0] = out[1] = NULL;
    cJSON *p = NULL; /* the prompt, owned */
    cJSON *side[2] = {NULL, NULL};
    int rc = QT_OK;
    if (conv) { /* LLaMA-Factory ShareGPT */
        if (!cJSON_IsArray(conv)) return QT_ERR(QT_EFORMAT, "\"conversations\" must be a list of {\"from\", \"value\"}");
        p = cJSON_CreateArray();
        const cJSON *sys = get(obj, "system");
        if (p && cJSON_IsString(sys) && sys->valuestring[0]) cJSON_AddItemToArray(p, message("system", sys->valuestring));
        const cJSON *m;
        cJSON_ArrayForEach(m, conv) {
            cJSON *x = sharegpt_message(m, "conversations[]");
            if (!x) { rc = QT_EFORMAT; break; }
            cJSON_AddItemToArray(p, x);
        }
        for (int s = 0; s < 2 && rc == QT_OK; s++) {
            cJSON *x = sharegpt_message(s ? rj : ch, s ? "rejected" : "chosen");
            if (!x) { rc = QT_EFORMAT; break; }
            side[s] = cJSON_CreateArray();
            cJSON_AddItemToArray(side[s], x);
        }
    } else if (instr) { /* LLaMA-Factory Alpaca: instruction + input as the user's turn */
        const cJSON *in = get(obj, "input");
        if (!cJSON_IsString(instr) || !cJSON_IsString(ch) || !cJSON_IsString(rj))
            return QT_ERR(QT_EFORMAT, "\"instruction\", \"chosen\" and \"rejected\" must be strings");
        size_t n = strlen(instr->valuestring) + (cJSON_IsString(in) ? strlen(in->valuestring) + 1 : 0) + 1;
        char *u = qt_malloc(n, "a prompt");
        if (!u) return QT_ENOMEM;
        snprintf(u, n, "%s%s%s", instr->valuestring, cJSON_IsString(in) && in->valuestring[0] ? "\n" : "",
                 cJSON_IsString(in) ? in->valuestring : "");
        p = cJSON_CreateArray();
        cJSON_AddItemToArray(p, message("user", u));
        qt_free(u);
        side[0] = cJSON_CreateString(ch->valuestring);
        side[1] = cJSON_CreateString(rj->valuestring);
    } else if (prompt) { /* TRL explicit prompt */
        p = cJSON_Duplicate(prompt, 1);
        side[0] = cJSON_Duplicate(ch, 1);
        side[1] = cJSON_Duplicate(rj, 1);
    } else if (cJSON_IsArray(ch) && cJSON_IsArray(rj)) { /* TRL implicit prompt: the shared leading messages */
        int n = 0, nc = cJSON_GetArraySize(ch), nr = cJSON_GetArraySize(rj);
        while (n < nc && n < nr && cJSON_Compare(cJSON_GetArrayItem(ch, n), cJSON_GetArrayItem(rj, n), 1)) n++;
        if (n == 0 || n == nc || n == nr)
            return QT_ERR(QT_EFORMAT, "without \"prompt\", \"chosen\" and \"rejected\" must start with the same "
                                      "prompt messages and differ after them (TRL's implicit prompt)");
        p = cJSON_CreateArray();
        for (int i = 0; i < n; i++) cJSON_AddItemToArray(p, cJSON_Duplicate(cJSON_GetArrayItem(ch, i), 1));
        for (int s = 0; s < 2; s++) {
            const cJSON *src = s ? rj : ch;
            side[s] = cJSON_CreateArray();
            for (int i = n; i < cJSON_GetArraySize(src); i++)
                cJSON_AddItemToArray(side[s], cJSON_Duplicate(cJSON_GetArrayItem(src, i), 1));
        }
    } else {
        return QT_ERR(QT_EFORMAT, "a preference example needs \"prompt\" (or LLaMA-Factory's \"conversations\" or "
                                  "\"instruction\") beside \"chosen\" and \"rejected\"");
    }
    for (int s = 0; s < 2 && rc == QT_OK; s++) {
        cJSON *ps = p ? cJSON_Duplicate(p, 1) : NULL; /* each side its own copy of the prompt */
        out[s] = cJSON_CreateObject();
        if (!out[s] || !ps || !side[s]) {
            cJSON_Delete(ps);
            rc = QT_ERR(QT_ENOMEM, "out of memory building a preference example");
            break;
        }
        cJSON_AddItemToObject(out[s], "prompt", ps);
        cJSON_AddItemToObject(out[s], "completion", side[s]);
        side[s] = NULL;
    }
    cJSON_Delete(p);
    cJSON_Delete(side[0]);
    cJSON_Delete(side[1]);
    if (rc != QT_OK) {
        cJSON_Delete(out[0]);
        cJSON_Delete(out[1]);
        out[0] = out[1] = NULL;
    }
    return rc;
}

static int add_side(dl_pref_set *set, dl_tokbuf *buf, int64_t s, size_t n0, int seq_len) {
    size_t len = buf->n - n0, prompt = 0;
    while (prompt < len && !buf->mask[n0 + prompt]) prompt++;
    if (len > (size_t)seq_len) {
        buf->n = n0 + (size_t)seq_len;
        set->n_truncated++;
    }
    /* a label on token t is a target of position t - 1: the first token's cannot count */
    size_t labelled = 0;
    for (size_t i = n0 + 1; i < buf->n; i++) labelled += buf->mask[i];
    if (!labelled)
        return QT_ERR(QT_EFORMAT, "the %s answer has no token within data.seq_len %d (the prompt takes %zu tokens); "
                                  "raise data.seq_len or shorten the prompt",
                      s % 2 ? "rejected" : "chosen", seq_len, prompt);
    set->start[s + 1] = (int64_t)buf->n;
    return QT_OK;
}

int dl_pref_load(const char *path, const bpe_tokenizer *tok, int seq_len, dl_pref_set *set) {
    memset(set, 0, sizeof *set);
    if (!tok)
        return QT_ERR(QT_EINVAL, "%s: preference data needs the model's tokenizer (tokenizer.json in the model folder)",
                      path);
    char *text;
    size_t len;
    QT_TRY(qt_read_file(path, PREF_MAX_FILE, &text, &len));
    int64_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    set->start = qt_calloc((size_t)(2 * lines + 1), sizeof(int64_t), "preference sides");
    if (!set->start) {
        qt_free(text);
        return QT_ENOMEM;
    }
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1};
    dl_tokbuf buf = {0};
    int rc = QT_OK;
    long long line_no = 0;
    for (char *s = text, *end = text + len; s < end && rc == QT_OK;) {
        char *nl = memchr(s, '\n', (size_t)(end - s));
        char *e = nl ? nl : end;
        line_no++;
        char *q = s;
        while (q < e && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
        if (q < e) {
            cJSON *obj = cJSON_ParseWithLength(s, (size_t)(e - s));
            cJSON *pc[2] = {NULL, NULL};
            if (!cJSON_IsObject(obj)) rc = QT_ERR(QT_EFORMAT, "not one JSON object");
            else if (!dl_pref_detect(obj))
                rc = QT_ERR(QT_EFORMAT, "no \"chosen\" and \"rejected\": preference training (objective dpo, orpo, "
                                        "simpo) reads pairs (docs/preference.md)");
            if (rc == QT_OK) rc = to_prompt_completion(obj, pc);
            for (int side = 0; side < 2 && rc == QT_OK; side++) {
                int64_t sid = 2 * set->n_pairs + side;
                size_t n0 = buf.n;
                rc = dl_encode_example(&ctx, DL_FORMAT_PROMPT_COMPLETION, pc[side], &buf);
                if (rc == QT_OK) rc = add_side(set, &buf, sid, n0, seq_len);
            }
            cJSON_Delete(pc[0]);
            cJSON_Delete(pc[1]);
            cJSON_Delete(obj);
            if (rc == QT_OK) set->n_pairs++;
            else rc = qt_error_context(rc, "%s:%lld", path, line_no);
        }
        s = nl ? nl + 1 : end;
    }
    qt_free(text);
    if (rc == QT_OK && set->n_pairs == 0) rc = QT_ERR(QT_EFORMAT, "%s holds no preference example", path);
    if (rc != QT_OK) {
        dl_tokbuf_free(&buf);
        dl_pref_free(set);
        return rc;
    }
    set->ids = buf.ids;
    set->mask = buf.mask;
    int32_t eot = bpe_token_id(tok, "<|endoftext|>");
    set->pad_id = eot >= 0 ? eot : 0;
    return QT_OK;
}

void dl_pref_free(dl_pref_set *set) {
    qt_free(set->ids);
    qt_free(set->mask);
    qt_free(set->start);
    memset(set, 0, sizeof *set);
}

void dl_pref_batch(const dl_pref_set *set, const int64_t *idx, int P, int T, qt_batch *b) {
    b->B = 2 * P;
    b->T = T;
    b->n_target = 0;
    for (int r = 0; r < 2 * P; r++) {
        int64_t s = 2 * idx[r % P] + (r >= P);
        const int32_t *ids = set->ids + set->start[s];
        const uint8_t *mask = set->mask + set->start[s];
        int L = (int)(set->start[s + 1] - set->start[s]);
        size_t base = (size_t)r * T;
        for (int t = 0; t < T; t++) {
            int in = t < L;
            b->inputs[base + t] = in ? ids[t] : set->pad_id;
            /* position t predicts token t+1 of the same side, when that one carries a label */
            b->targets[base + t] = t + 1 < L && mask[t + 1] ? ids[t + 1] : QT_IGNORE_INDEX;
            b->positions[base + t] = in ? t : t - L; /* the padding is its own example, as the loader pads */
            b->doc_start[base + t] = in ? 0 : L;
            b->n_target += b->targets[base + t] != QT_IGNORE_INDEX;
        }
    }
}
