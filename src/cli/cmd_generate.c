/* qtune generate: KV-cached decoding of a model (optionally with a PEFT
 * adapter) from a prompt, or an interactive ChatML chat on stdin. Tokens are
 * printed as they come; a character split over several byte-level tokens is
 * held back until it is whole. See docs/generate.md. */
#define _GNU_SOURCE /* strcasestr, getline */
#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/messages.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "model/decode.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "model/sample.h"
#include "text/chat.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static void generate_help(void) {
    printf("usage: qtune generate --model DIR [--adapter DIR] (--prompt TEXT | --prompt-ids LIST | --prompts FILE | --chat)\n"
           "                      [options]\n\n"
           "Generates text with a KV cache, printing tokens as they come. Stops at <|im_end|>,\n"
           "<|endoftext|>, the eos_token_id ids of config.json and generation_config.json, or after\n"
           "--max-new tokens.\n\n"
           "  --model DIR        Hugging Face model folder (config.json, safetensors, tokenizer.json)\n"
           "  --adapter DIR      PEFT LoRA adapter folder to apply\n"
           "  --quantization nf4|fp4  the base's layer linears in 4 bits (QLoRA), --double-quant for double quantization\n"
           "  --tokenizer PATH   tokenizer.json (or a folder holding one) when --model has none\n"
           "  --prompt TEXT      continue this text (no template)\n"
           "  --chat             chat with the model folder's chat template (qtune's ChatML when it ships none):\n"
           "                     each stdin line is a user turn; the history is kept\n"
           "  --system TEXT      system message for --chat, only there (default: the template's own, if any)\n"
           "  --enable-thinking true|false  the chat template's enable_thinking (Qwen3: false writes an empty\n"
           "                     think block after the assistant header, so the reply skips reasoning)\n"
           "  --max-new N        new tokens per reply (default 256)\n"
           "  --temperature t    0 is greedy (default 0.7)\n"
           "  --top-k k          keep the k most probable tokens (default 0: off)\n"
           "  --top-p p          keep the most probable tokens up to mass p (default 1: off)\n"
           "  --seed s           sampling seed, 0 to 18446744073709551615 (default 42)\n"
           "  --ctx N            context length: at most N tokens in all, prompt (and chat history) plus\n"
           "                     reply; at most max_position_embeddings (default min(that, 4096))\n"
           "  --prompt-ids LIST  comma-separated token ids instead of --prompt (no tokenizer needed)\n"
           "  --prompts FILE     many prompts, JSON Lines: {\"prompt\": TEXT}, {\"prompt_ids\": [ids]} or\n"
           "                     {\"messages\": [{\"role\": ..., \"content\": ...}]} (rendered as --chat does, with\n"
           "                     the assistant's turn opened) per line; the replies come in the file's\n"
           "                     order, each sampled with --seed\n"
           "                     as its own run would be\n"
           "  --batch N          with --prompts: N sequences decode together, each weight read once a\n"
           "                     step for all of them (default 1); greedy replies equal separate runs'\n"
           "  --json             print one JSON object per reply instead of streaming: prompt_ids, ids,\n"
           "                     text, stop, prefill_s, decode_s, decode_tokens_per_s\n"
           "  --device D         auto (default: a GPU, else an Ascend NPU, else the CPU), cpu, cuda,\n"
           "                     cuda:N (GPU N), npu, npu:N; QTUNE_BACKEND, when set, wins\n");
}

typedef struct {
    qt_decoder d;       /* the decode loop (model/decode.h), once the model is loaded */
    bpe_tokenizer *tok; /* NULL with --prompt-ids and no tokenizer.json */
    int ctx, max_ctx;   /* the context (prepare) and the model's positions: the largest --ctx */
    int json;
    char *reply;        /* text of the last reply (qt_free), for the chat history */
} gen_state;

/* Flushes the reply so far. A write that failed (a full disk, a closed
 * stdout) stops the generation with an error: the text would be lost while
 * the exit status said all was well. */
static int flush_stdout(void) {
    errno = 0; /* a failed fflush sets it; a stream error from an earlier write may leave it 0 (then EIO) */
    if (fflush(stdout) == 0 && !ferror(stdout)) return QT_OK;
    return QT_ERR(QT_EIO, "cannot write the reply to standard output (%s); generation stopped: check the disk or "
                  "the program reading the output", strerror(errno ? errno : EIO));
}

/* Streams the text of byte-level tokens: pending ids are decoded together,
 * and held back while they end in an incomplete UTF-8 character (the
 * decoder's U+FFFD) — at most 4 tokens, the longest a character can span. */
typedef struct {
    int32_t ids[8];
    int n;
} utf8_stream;

static int stream_push(utf8_stream *s, const bpe_tokenizer *tok, int32_t id, int flush) {
    if (id >= 0) s->ids[s->n++] = id;
    if (!s->n) return QT_OK;
    char *text;
    size_t len;
    QT_TRY(bpe_decode(tok, s->ids, (size_t)s->n, &text, &len));
    const int partial = len >= 3 && !memcmp(text + len - 3, "\xEF\xBF\xBD", 3);
    if (!partial || flush || s->n >= 4) {
        fwrite(text, 1, len, stdout);
        s->n = 0;
    }
    qt_free(text);
    return flush_stdout();
}

static void json_ids(cJSON *o, const char *k, const int32_t *ids, int n) {
    cJSON *a = cJSON_AddArrayToObject(o, k);
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
}

/* qt_decode_reply's token callback: the reply's text streams as it comes
 * (its ids when there is no tokenizer); --json prints it whole at the end. */
typedef struct {
    const gen_state *g;
    utf8_stream us;
} reply_stream;

static int print_token(void *user, int32_t id) {
    reply_stream *s = user;
    if (s->g->json) return QT_OK;
    if (s->g->tok) return stream_push(&s->us, s->g->tok, id, 0);
    printf("%d ", id);
    return flush_stdout();
}

/* One reply to n prompt ids after the cached positions (qt_decode_reply),
 * streamed, or printed as one JSON object. */
static int generate_reply(gen_state *g, const int32_t *ids, int n) {
    reply_stream st = {g, {{0}, 0}};
    qt_decode_result r;
    int rc = qt_decode_reply(&g->d, ids, n, print_token, &st, &r);
    if (!r.out) return rc; /* the prompt did not fit, or no memory: nothing was decoded */
    qt_free(g->reply);
    g->reply = NULL;
    if (rc == QT_OK && g->tok) {
        size_t len;
        rc = bpe_decode(g->tok, r.out, (size_t)r.n_out, &g->reply, &len);
    }
    if (rc == QT_OK && !g->json && g->tok) rc = stream_push(&st.us, g->tok, -1, 1);
    if (rc == QT_OK && !g->json) printf("\n");
    if (rc == QT_OK && g->json) {
        cJSON *o = cJSON_CreateObject();
        json_ids(o, "prompt_ids", ids, n);
        json_ids(o, "ids", r.out, r.n_out);
        if (g->reply) cJSON_AddStringToObject(o, "text", g->reply);
        cJSON_AddStringToObject(o, "stop", r.stop);
        cJSON_AddNumberToObject(o, "prefill_s", r.prefill_s);
        cJSON_AddNumberToObject(o, "decode_s", r.decode_s);
        /* one-position decode calls (each with its sampling) per second */
        cJSON_AddNumberToObject(o, "decode_tokens_per_s", r.n_dec > 0 && r.decode_s > 0 ? r.n_dec / r.decode_s : 0);
        char *s = cJSON_PrintUnformatted(o);
        if (s) printf("%s\n", s);
        cJSON_free(s);
        cJSON_Delete(o);
    }
    if (rc == QT_OK) rc = flush_stdout();
    qt_decode_result_free(&r);
    return rc;
}

static int encode(const bpe_tokenizer *t, const char *text, int32_t **ids, size_t *n) {
    size_t cap = 0;
    *ids = NULL;
    *n = 0;
    return bpe_encode(t, text, strlen(text), ids, n, &cap);
}

/* The documented rule for the "never stops" warning (docs/generate.md): the
 * embedding row of <|im_end|> is (near) zero against the typical row (the
 * adapter's own embedding when its modules_to_save trained one), or an
 * adapter without modules_to_save is applied to a base whose folder is not
 * an instruct/chat model (a LoRA on projections cannot teach a token the
 * base never saw). */
static void warn_untrained_chat(const char *model_dir, const char *adapter, int32_t im_end) {
    char reason[512] = "";
    st_file *st = NULL, *ad = NULL;
    /* an adapter with modules_to_save trains more than projections: its own embedding is the one to look at */
    int saves = 0;
    peft_config *pc = adapter ? qt_calloc(1, sizeof *pc, "adapter config") : NULL;
    if (pc && peft_config_load(adapter, pc) == QT_OK) saves = pc->n_save > 0;
    qt_free(pc);
    if (im_end < 0) {
        snprintf(reason, sizeof reason, "the tokenizer has no <|im_end|> token");
    } else if (st_open(model_dir, &st) == QT_OK) {
        const st_tensor *e = NULL;
        if (saves && peft_open_weights(adapter, &ad) == QT_OK) {
            e = st_find(ad, "base_model.model.model.embed_tokens.weight");
            if (!e) e = st_find(ad, "base_model.model.transformer.wte.weight");
        }
        if (!e) e = st_find(st, "model.embed_tokens.weight");
        if (!e) e = st_find(st, "transformer.wte.weight"); /* the original Qwen */
        if (e && e->ndim == 2 && e->shape[0] > 0 && e->shape[1] > 0 && e->shape[1] <= 65536) {
            const int64_t V = e->shape[0], C = e->shape[1];
            const size_t es = qt_dtype_size(e->dtype);
            float *row = qt_malloc((size_t)C * sizeof *row, "an embedding row");
            if (row && im_end >= V) {
                snprintf(reason, sizeof reason, "its id %d is outside the %lld-row embedding", im_end, (long long)V);
            } else if (row) {
                double norms[256];
                int k = 0;
                for (int64_t i = 0; i < V && k < 256; i += V / 256 > 0 ? V / 256 : 1) {
                    qt_convert_to_f32(row, (const char *)e->data + (size_t)i * (size_t)C * es, e->dtype, (size_t)C);
                    double s = 0;
                    for (int64_t j = 0; j < C; j++) s += (double)row[j] * row[j];
                    norms[k++] = sqrt(s);
                }
                qt_convert_to_f32(row, (const char *)e->data + (size_t)im_end * (size_t)C * es, e->dtype, (size_t)C);
                double s = 0;
                for (int64_t j = 0; j < C; j++) s += (double)row[j] * row[j];
                /* median of the sampled norms (insertion sort: 256 values) */
                for (int i = 1; i < k; i++)
                    for (int j = i; j > 0 && norms[j - 1] > norms[j]; j--) {
                        double t = norms[j];
                        norms[j] = norms[j - 1];
                        norms[j - 1] = t;
                    }
                const double med = k ? norms[k / 2] : 0;
                if (sqrt(s) < 0.1 * med)
                    snprintf(reason, sizeof reason, "its embedding row has norm %.3g against a typical %.3g", sqrt(s),
                             med);
            }
            qt_free(row);
        }
        st_close(ad);
        st_close(st);
    }
    qt_error_clear();
    if (!reason[0] && adapter && !saves) {
        const char *base = strrchr(model_dir, '/');
        char name[512];
        snprintf(name, sizeof name, "%s", base && base[1] ? base + 1 : model_dir);
        if (!strcasestr(name, "instruct") && !strcasestr(name, "chat"))
            snprintf(reason, sizeof reason,
                     "the adapter trains only projections and the base folder '%.120s' is not an Instruct/Chat model",
                     name);
    }
    if (reason[0]) qt_warn(QT_MSG_CHAT_UNTRAINED_FMT, "<|im_end|>", reason);
}

/* A chat: the messages so far are rendered with the model's ChatML template
 * (text/chat.h, the one training uses) and tokenized; only the ids after the
 * longest prefix already in the KV cache are fed, so the cache carries the
 * history and a reply that re-tokenizes differently is corrected from where it
 * differs. */
static int chat_loop(gen_state *g, const char *system) {
    const int tty = isatty(0);
    char *line = NULL;
    size_t cap = 0;
    int rc = QT_OK, n_msg = 0, cap_msg = 0;
    chat_message *msgs = NULL;
    char **owned = NULL; /* contents this loop allocated, one per message */
    if (system) {
        cap_msg = 8;
        msgs = qt_malloc((size_t)cap_msg * sizeof *msgs, "chat messages");
        owned = qt_calloc((size_t)cap_msg, sizeof *owned, "chat messages");
        if (!msgs || !owned) rc = QT_ENOMEM;
        else msgs[n_msg++] = (chat_message){.role = "system", .content = system};
    }
    while (rc == QT_OK) {
        if (tty) fprintf(stderr, "user> "), fflush(stderr);
        ssize_t r = getline(&line, &cap, stdin);
        if (r < 0) break;
        while (r > 0 && (line[r - 1] == '\n' || line[r - 1] == '\r')) line[--r] = 0;
        if (!r) continue;
        if (n_msg + 2 > cap_msg) {
            int nc = cap_msg ? 2 * cap_msg : 8;
            chat_message *m2 = qt_realloc(msgs, (size_t)nc * sizeof *msgs, "chat messages");
            if (m2) msgs = m2;
            char **o2 = m2 ? qt_realloc(owned, (size_t)nc * sizeof *owned, "chat messages") : NULL;
            if (!o2) {
                rc = QT_ENOMEM;
                break;
            }
            owned = o2;
            for (int i = cap_msg; i < nc; i++) owned[i] = NULL;
            cap_msg = nc;
        }
        owned[n_msg] = qt_strdup(line);
        if (!owned[n_msg]) {
            rc = QT_ENOMEM;
            break;
        }
        msgs[n_msg] = (chat_message){.role = "user", .content = owned[n_msg]};
        n_msg++;
        char *text = NULL;
        size_t len;
        int32_t *ids = NULL;
        size_t n = 0;
        rc = chat_render_tok(g->tok, msgs, (size_t)n_msg, NULL, 1, &text, &len);
        if (rc == QT_OK) rc = encode(g->tok, text, &ids, &n);
        qt_free(text);
        int k = 0; /* ids already in the KV cache */
        while (rc == QT_OK && k < g->d.pos && (size_t)k < n - 1 && g->d.hist[k] == ids[k]) k++;
        if (rc == QT_OK) {
            g->d.pos = k;
            if (tty && !g->json) fprintf(stderr, "assistant> "), fflush(stderr);
            rc = generate_reply(g, ids + k, (int)(n - (size_t)k));
        }
        qt_free(ids);
        if (rc == QT_OK) {
            owned[n_msg] = g->reply; /* the history keeps the reply's text */
            g->reply = NULL;
            msgs[n_msg] = (chat_message){.role = "assistant", .content = owned[n_msg] ? owned[n_msg] : ""};
            n_msg++;
        }
    }
    for (int i = 0; owned && i < n_msg; i++) qt_free(owned[i]);
    qt_free(owned);
    qt_free(msgs);
    free(line);
    return rc;
}

/* ---- --prompts FILE [--batch N]: many prompts, N sequences decoding together ---- */

/* One prompt of the file: its ids, and once done its reply. */
typedef qt_decode_seq gen_prompt;

static void free_prompts(gen_prompt *p, int n) {
    for (int i = 0; p && i < n; i++) qt_free(p[i].ids), qt_free(p[i].out);
    qt_free(p);
}

/* The prompts file: JSON Lines, one object per line with "prompt" (text, needs
 * the tokenizer) or "prompt_ids" (an array of ids); blank lines are skipped.
 * Other keys are ignored, and the first one is named in a warning. */
/* A --prompts line's "messages" (OpenAI / HF chat form): rendered with the chat
 * template training uses (text/chat.h) and the assistant's generation prompt,
 * as `generate --chat` renders its history, then tokenized. */
static int messages_prompt(const bpe_tokenizer *tok, const cJSON *arr, const char *path, int lineno, int32_t **ids,
                           size_t *n) {
    const int count = cJSON_GetArraySize(arr);
    if (count < 1) return QT_ERR(QT_EINVAL, "%s line %d: \"messages\" is empty; give at least one user turn", path, lineno);
    chat_message *m = qt_calloc((size_t)count, sizeof *m, "prompt messages");
    if (!m) return QT_ENOMEM;
    int i = 0, rc = QT_OK;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
            rc = QT_ERR(QT_EINVAL, "%s line %d: messages[%d] must be {\"role\": \"system\" | \"user\" | \"assistant\", "
                        "\"content\": \"text\"}", path, lineno, i);
            break;
        }
        /* OpenAI's "developer" is its newer name for the system message */
        m[i++] = (chat_message){.role = strcmp(role->valuestring, "developer") ? role->valuestring : "system",
                                .content = content->valuestring};
    }
    char *text = NULL;
    size_t len;
    if (rc == QT_OK) rc = chat_render_tok(tok, m, (size_t)i, NULL, 1, &text, &len);
    if (rc != QT_OK && rc != QT_ENOMEM && qt_error_code()) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", qt_error_message());
        if (!strstr(msg, path)) rc = QT_ERR(rc, "%s line %d: %s", path, lineno, msg);
    }
    if (rc == QT_OK) rc = encode(tok, text, ids, n);
    qt_free(text);
    qt_free(m);
    return rc;
}

static int read_prompts(const char *path, const bpe_tokenizer *tok, int V, int ctx, int max_ctx, gen_prompt **out,
                        int *count) {
    char *buf;
    size_t len;
    *out = NULL, *count = 0;
    QT_TRY(qt_read_file(path, (size_t)1 << 32, &buf, &len));
    int rc = QT_OK, cap = 0, lineno = 0, warned = 0;
    gen_prompt *p = NULL;
    for (char *s = buf, *e; rc == QT_OK && s < buf + len; s = e + 1) {
        e = memchr(s, '\n', (size_t)(buf + len - s));
        if (!e) e = buf + len;
        *e = 0;
        lineno++;
        const char *t = s;
        while (isspace((unsigned char)*t)) t++;
        if (t == e) continue;
        if (*count == cap) {
            cap = cap ? 2 * cap : 16;
            gen_prompt *q = qt_realloc(p, (size_t)cap * sizeof *p, "the prompts");
            if (!q) {
                rc = QT_ENOMEM;
                break;
            }
            p = q;
        }
        gen_prompt *g = &p[*count];
        memset(g, 0, sizeof *g);
        (*count)++;
        const int nul = memchr(s, 0, (size_t)(e - s)) != NULL;
        const char *after = NULL; /* cJSON stops after the value: what follows would be dropped unseen */
        cJSON *o = nul ? NULL : cJSON_ParseWithLengthOpts(t, (size_t)(e - t), &after, 0);
        while (o && after < e && isspace((unsigned char)*after)) after++;
        const cJSON *text = o ? cJSON_GetObjectItemCaseSensitive(o, "prompt") : NULL;
        const cJSON *arr = o ? cJSON_GetObjectItemCaseSensitive(o, "prompt_ids") : NULL;
        const cJSON *msgs = o ? cJSON_GetObjectItemCaseSensitive(o, "messages") : NULL;
        if (nul) {
            rc = QT_ERR(QT_EINVAL, "%s line %d holds a NUL byte; a JSON Lines file is text: fix or remove that line",
                        path, lineno);
        } else if (o && after < e) {
            rc = QT_ERR(QT_EINVAL, "%s line %d: text after the JSON object (byte %zu); put one object per line", path,
                        lineno, (size_t)(after - s) + 1);
        } else if (cJSON_IsString(text) && qt_json_has_nul_escape(t, (size_t)(e - t))) {
            rc = QT_ERR(QT_EINVAL, "%s line %d holds a NUL character (\\u0000), where the prompt's text would end; "
                        "remove it", path, lineno);
        } else if (!cJSON_IsObject(o) || cJSON_IsString(text) + cJSON_IsArray(arr) + cJSON_IsArray(msgs) != 1) {
            rc = QT_ERR(QT_EINVAL, "%s line %d: each line must be a JSON object with a \"prompt\" string, a "
                        "\"prompt_ids\" array of token ids or a \"messages\" array of {\"role\", \"content\"} "
                        "(one of the three)", path, lineno);
        } else if (cJSON_IsArray(msgs)) {
            size_t n = 0;
            if (!tok) rc = QT_ERR(QT_EINVAL, "%s line %d: \"messages\" need the model's tokenizer.json (or "
                                  "--tokenizer); give \"prompt_ids\" instead", path, lineno);
            else if ((rc = messages_prompt(tok, msgs, path, lineno, &g->ids, &n)) == QT_OK) g->n = (int)n;
        } else if (cJSON_IsString(text)) {
            size_t n = 0;
            if (!tok) rc = QT_ERR(QT_EINVAL, "%s line %d: a \"prompt\" text needs the model's tokenizer.json (or "
                                  "--tokenizer); give \"prompt_ids\" instead", path, lineno);
            else if ((rc = encode(tok, text->valuestring, &g->ids, &n)) == QT_OK) g->n = (int)n;
        } else {
            g->n = cJSON_GetArraySize(arr);
            g->ids = qt_malloc((size_t)(g->n ? g->n : 1) * sizeof *g->ids, "prompt ids");
            if (!g->ids) rc = QT_ENOMEM;
            int i = 0;
            const cJSON *v;
            cJSON_ArrayForEach(v, arr) {
                if (rc != QT_OK) break;
                if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= V ||
                    v->valuedouble != (double)(int32_t)v->valuedouble)
                    rc = QT_ERR(QT_EINVAL, "%s line %d: prompt_ids[%d] is not a token id of the model (a whole "
                                "number from 0 to %d)", path, lineno, i, V - 1);
                else g->ids[i++] = (int32_t)v->valuedouble;
            }
        }
        /* any other key, a repeated one included, is named once per file */
        const cJSON *used = cJSON_IsString(text) ? text : cJSON_IsArray(arr) ? arr : msgs;
        for (const cJSON *k = rc == QT_OK ? o->child : NULL; k && !warned; k = k->next)
            if (k != used)
                warned = 1, qt_warn("%s line %d: the key \"%.64s\" is ignored: a line gives one \"prompt\" string, "
                                    "one \"prompt_ids\" array or one \"messages\" array, nothing else (further "
                                    "ignored keys are not named)",
                                    path, lineno, k->string);
        cJSON_Delete(o);
        if (rc == QT_OK && qt_decode_check_prompt(0, g->n, ctx, max_ctx) != QT_OK)
            rc = QT_ERR(QT_EINVAL, "%s line %d: %s", path, lineno, qt_error_message());
    }
    qt_free(buf);
    if (rc == QT_OK && !*count) rc = QT_ERR(QT_EINVAL, "%s holds no prompts; give one JSON object per line", path);
    if (rc != QT_OK) free_prompts(p, *count), p = NULL, *count = 0;
    *out = p;
    return rc;
}

/* qt_decode_batch's callback: a finished prompt's reply, as generate_reply
 * prints it. */
static int print_reply(void *user, const gen_prompt *p, int index) {
    const gen_state *g = user;
    char *text = NULL;
    size_t len = 0;
    if (g->tok) QT_TRY(bpe_decode(g->tok, p->out, (size_t)p->n_out, &text, &len));
    if (g->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "index", index);
        json_ids(o, "prompt_ids", p->ids, p->n);
        json_ids(o, "ids", p->out, p->n_out);
        if (text) cJSON_AddStringToObject(o, "text", text);
        cJSON_AddStringToObject(o, "stop", p->stop);
        cJSON_AddNumberToObject(o, "prefill_s", p->prefill_s);
        cJSON_AddNumberToObject(o, "decode_s", p->decode_s);
        /* this sequence's decode steps per second of its own decode time (shared with the batch) */
        cJSON_AddNumberToObject(o, "decode_tokens_per_s", p->n_dec > 0 && p->decode_s > 0 ? p->n_dec / p->decode_s : 0);
        char *s = cJSON_PrintUnformatted(o);
        if (s) printf("%s\n", s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else if (text) {
        fwrite(text, 1, len, stdout);
        printf("\n");
    } else {
        for (int i = 0; i < p->n_out; i++) printf("%d ", p->out[i]);
        printf("\n");
    }
    qt_free(text);
    return flush_stdout();
}

/* --prompt-ids: whole numbers 0..INT32_MAX separated by commas (spaces
 * around them allowed); an empty item, a sign or any other text is refused
 * with the sentence the usage error prints. On failure *ids is NULL. */
static int parse_ids(const char *s, int32_t **ids, size_t *n) {
    size_t cap = 16;
    *n = 0;
    *ids = qt_malloc(cap * sizeof **ids, "prompt ids");
    if (!*ids) return QT_ENOMEM;
    int rc = QT_OK;
    for (const char *p = s;;) {
        while (*p == ' ') p++;
        const char *item = p;
        long long v = 0;
        while (isdigit((unsigned char)*p) && v <= INT32_MAX) v = v * 10 + (*p++ - '0');
        while (*p == ' ') p++;
        if (p == item || v > INT32_MAX || (*p && *p != ',')) {
            const char *at = v > INT32_MAX ? item : p;
            rc = QT_ERR(QT_EINVAL, "--prompt-ids must be token ids (whole numbers from 0 to %d) separated by commas, "
                        "not '%.64s' (wrong at character %zu)", INT32_MAX, s, (size_t)(at - s) + 1);
            break;
        }
        if (*n == cap) {
            int32_t *q = qt_realloc(*ids, cap * 2 * sizeof **ids, "prompt ids");
            if (!q) {
                rc = QT_ENOMEM;
                break;
            }
            *ids = q;
            cap *= 2;
        }
        (*ids)[(*n)++] = (int32_t)v;
        if (!*p) break;
        p++; /* the comma: an item must follow */
    }
    if (rc != QT_OK) {
        qt_free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return rc;
}

/* --seed: a whole number 0..UINT64_MAX, the type qt_rng_seed takes (unsigned
 * long long is 64 bits wherever qtune builds). strtoull alone would accept
 * "-1" (as UINT64_MAX), leading spaces and "+", and clamp past the range. */
static int parse_seed(const char *v, uint64_t *seed) {
    if (!isdigit((unsigned char)v[0])) return QT_EINVAL;
    errno = 0;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || errno == ERANGE) return QT_EINVAL;
    *seed = (uint64_t)x;
    return QT_OK;
}

/* What the small files decide, before the model is loaded: the tokenizer, the
 * config, the context length and the prompt's ids (*ids already holds
 * --prompt-ids, else `prompt` is encoded; chat: neither). tok_optional: a
 * missing tokenizer.json is no error (--prompts may hold ids only). Returns an
 * exit status, the error printed, or QT_EXIT_OK. */
static int prepare(gen_state *g, qt_config *cfg, const char *model, const char *tok_path, int ctx, const char *prompt,
                   int32_t **ids, size_t *n, int tok_optional) {
    if (tok_path && bpe_load(tok_path, &g->tok) != QT_OK) /* asked for: must load */
        return qt_error_oom_advice(qt_error_code(), QT_TOKENIZER_OOM_ADVICE), cli_fail();
    if (!tok_path && bpe_load(model, &g->tok) != QT_OK) {
        if (!*ids && !tok_optional) return qt_error_oom_advice(qt_error_code(), QT_TOKENIZER_OOM_ADVICE), cli_fail();
        g->tok = NULL; /* ids in, ids out */
        qt_error_clear();
    }
    if (qt_config_load(model, cfg) != QT_OK) return cli_fail();
    const int max_pos = qt_config_max_positions(cfg); /* >= 1 (hf_config.c) */
    if (ctx > max_pos)
        return cli_usage_error("generate", "--ctx %d is more than the model's %s (%d in %s/config.json); give --ctx %d "
                               "or less", ctx, max_pos < cfg->max_position_embeddings ? "seq_length" :
                               "max_position_embeddings", max_pos, model, max_pos);
    g->ctx = ctx ? ctx : max_pos < 4096 ? max_pos : 4096;
    g->max_ctx = max_pos;
    for (size_t i = 0; *ids && i < *n; i++)
        if ((*ids)[i] >= cfg->vocab_size)
            return cli_usage_error("generate", "--prompt-ids holds %d, outside the model's vocabulary of %d "
                                   "(vocab_size in %s/config.json)", (*ids)[i], cfg->vocab_size, model);
    if (prompt && encode(g->tok, prompt, ids, n) != QT_OK) return cli_fail();
    if ((prompt || *ids) && qt_decode_check_prompt(0, (int)*n, g->ctx, g->max_ctx) != QT_OK) return cli_fail();
    return QT_EXIT_OK;
}

int cmd_generate(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        generate_help();
        return QT_EXIT_OK;
    }
    const char *model = NULL, *adapter = NULL, *prompt = NULL, *prompt_ids = NULL, *tok_path = NULL;
    const char *system = NULL; /* the template's default system message */
    const char *device = NULL, *prompts_file = NULL;
    int chat = 0, json = 0, max_new = 256, ctx = 0, batch = 0, q4_type = -1, q4_nested = 0, thinking = -1;
    uint64_t seed = 42;
    qt_sample_opts so = {0.7f, 0, 1.0f};
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
#define NEED_VALUE() CLI_NEED_VALUE(&once, "generate", a, v, i)
        if (!strcmp(a, "--model")) { NEED_VALUE(); model = v; }
        else if (!strcmp(a, "--adapter")) { NEED_VALUE(); adapter = v; }
        else if (!strcmp(a, "--tokenizer")) { NEED_VALUE(); tok_path = v; }
        else if (!strcmp(a, "--double-quant")) q4_nested = 1;
        else if (!strcmp(a, "--quantization")) {
            NEED_VALUE();
            int st = cli_quant_type("generate", v, &q4_type);
            if (st != QT_EXIT_OK) return st;
        }
        else if (!strcmp(a, "--prompt")) { NEED_VALUE(); prompt = v; }
        else if (!strcmp(a, "--prompt-ids")) { NEED_VALUE(); prompt_ids = v; }
        else if (!strcmp(a, "--prompts")) { NEED_VALUE(); prompts_file = v; }
        else if (!strcmp(a, "--system")) { NEED_VALUE(); system = v; }
        else if (!strcmp(a, "--device")) { NEED_VALUE(); device = v; }
        else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--enable-thinking")) {
            NEED_VALUE();
            if (strcmp(v, "true") && strcmp(v, "false"))
                return cli_usage_error("generate", "--enable-thinking takes true or false, not '%s'", v);
            thinking = !strcmp(v, "true");
        }
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--max-new")) {
            NEED_VALUE();
            long x = strtol(v, &end, 10);
            if (*end || end == v || x < 1 || x > 1000000)
                return cli_usage_error("generate", "--max-new must be a whole number from 1 to 1000000, not '%s'", v);
            max_new = (int)x;
        } else if (!strcmp(a, "--batch")) {
            NEED_VALUE();
            long x = strtol(v, &end, 10);
            if (*end || end == v || x < 1 || x > 256)
                return cli_usage_error("generate", "--batch must be a whole number from 1 to 256, not '%s'", v);
            batch = (int)x;
        } else if (!strcmp(a, "--ctx")) {
            NEED_VALUE();
            long x = strtol(v, &end, 10);
            if (*end || end == v || x < 2 || x > (1 << 22))
                return cli_usage_error("generate", "--ctx must be a whole number from 2 to %d (and at most the "
                                       "model's max_position_embeddings), not '%s'", 1 << 22, v);
            ctx = (int)x;
        } else if (!strcmp(a, "--temperature") || !strcmp(a, "--top-p")) {
            NEED_VALUE();
            double x = strtod(v, &end);
            if (*end || end == v) return cli_usage_error("generate", "%s must be a number, not '%s'", a, v);
            if (!strcmp(a, "--temperature")) so.temperature = (float)x;
            else so.top_p = (float)x;
        } else if (!strcmp(a, "--top-k")) {
            NEED_VALUE();
            long x = strtol(v, &end, 10);
            if (*end || end == v || x < 0 || x > INT32_MAX)
                return cli_usage_error("generate", "--top-k must be a whole number >= 0, not '%s'", v);
            so.top_k = (int)x;
        } else if (!strcmp(a, "--seed")) {
            NEED_VALUE();
            if (parse_seed(v, &seed) != QT_OK)
                return cli_usage_error("generate", "--seed must be a whole number from 0 to %llu, not '%s'",
                                       (unsigned long long)UINT64_MAX, v);
        } else return cli_usage_error("generate", "unknown option '%s'", a);
#undef NEED_VALUE
    }
    if (!model) return cli_usage_error("generate", "--model DIR is required");
    if (adapter && cli_check_adapter(adapter) != QT_OK) return cli_fail();
    if ((prompt != NULL) + (prompt_ids != NULL) + chat + (prompts_file != NULL) != 1)
        return cli_usage_error("generate", "give exactly one of --prompt TEXT, --prompt-ids LIST, --prompts FILE or "
                               "--chat");
    if (batch && !prompts_file)
        return cli_usage_error("generate", "--batch N decodes the prompts of --prompts FILE together; give --prompts");
    if (system && !chat) /* a --prompt is continued as is: the system message would be dropped unseen */
        return cli_usage_error("generate", "--system TEXT is the system message of --chat; give --chat (--prompt "
                               "text is continued as is, with no template)");
    if (thinking >= 0 && !chat)
        return cli_usage_error("generate", "--enable-thinking is a variable of the chat template; give --chat");
    if (!batch) batch = 1;
    if (qt_sample_opts_check(&so) != QT_OK) return cli_usage_error("generate", "%s", qt_error_message());
    /* The prompt: ids are checked here, before anything is read */
    int32_t *ids = NULL;
    size_t n_ids = 0;
    const int parsed = prompt_ids ? parse_ids(prompt_ids, &ids, &n_ids) : QT_OK;
    if (parsed == QT_ENOMEM) return cli_fail();
    if (parsed != QT_OK) return cli_usage_error("generate", "%s", qt_error_message());
    qt_device dev;
    const int dst = cli_device("generate", device, &dev);
    if (dst != QT_EXIT_OK) {
        qt_free(ids);
        return dst;
    }
    gen_state g;
    memset(&g, 0, sizeof g);
    qt_config cfg;
    int status = prepare(&g, &cfg, model, tok_path, ctx, prompt, &ids, &n_ids, prompts_file != NULL);
    if (status == QT_EXIT_OK && thinking >= 0) { /* apply_chat_template(..., enable_thinking=...) */
        chat_template *ct = g.tok ? bpe_chat_template_mut(g.tok) : NULL;
        cJSON *b = cJSON_CreateBool(thinking);
        if (!ct) {
            char desc[512];
            chat_template_describe(g.tok, desc, sizeof desc);
            status = cli_usage_error("generate", "--enable-thinking needs the model's own chat template, and this "
                                     "model chats in %s", desc);
        } else if (!b || chat_template_set_var(ct, "enable_thinking", b) != QT_OK) {
            status = cli_fail();
        }
        cJSON_Delete(b);
    }
    gen_prompt *prompts = NULL;
    int n_prompts = 0;
    /* every eos id of config.json and generation_config.json (Llama 3.1: <|eot_id|> is the third), read
     * before the weights so a broken generation_config.json is reported at once */
    int32_t eos[QT_DECODE_MAX_STOP];
    int n_eos = 0;
    if (status == QT_EXIT_OK &&
        ((prompts_file && read_prompts(prompts_file, g.tok, cfg.vocab_size, g.ctx, g.max_ctx, &prompts, &n_prompts) != QT_OK) ||
         qt_eos_ids_load(model, eos, QT_DECODE_MAX_STOP, &n_eos) != QT_OK)) {
        free_prompts(prompts, n_prompts);
        qt_free(ids);
        bpe_free(g.tok);
        return cli_fail();
    }
    if (status != QT_EXIT_OK) {
        qt_free(ids);
        bpe_free(g.tok);
        return status;
    }
    if (batch > n_prompts && prompts_file) batch = n_prompts; /* no slot without a prompt */
    int rc = QT_OK;
    g.json = json;
    qt_model *m = NULL;
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.infer = 1;
    mo.max_T = g.ctx;
    mo.backend = dev.backend;
    mo.device_index = dev.index;
    mo.decode_seqs = batch;                     /* a KV cache slot per sequence decoding together */
    mo.quant4 = q4_type >= 0, mo.quant4_type = q4_type, mo.quant4_nested = q4_nested; /* decode reads 4 bits */
    mo.progress = stderr;
    mo.max_B = (batch + g.ctx - 1) / g.ctx;     /* activations for a step of `batch` rows (1 unless ctx < batch) */
    if (adapter && qt_lora_opts_from_adapter(adapter, &cfg, &mo) != QT_OK) rc = QT_EINVAL;
    if (rc == QT_OK) mo.lora_dropout = 0; /* inference: dropout is off */
    if (rc == QT_OK) rc = qt_model_load(model, &mo, &m);
    if (rc == QT_OK && adapter) rc = qt_lora_load(m, adapter);
    if (rc == QT_OK) {
        /* Real Qwen models pad the embedding past the tokenizer (151936 rows,
         * 151665 tokens): ids with no token are never sampled, as HF would
         * never emit text for them. */
        int v_sample = qt_model_config(m)->vocab_size;
        if (g.tok && bpe_vocab_size(g.tok) < v_sample) v_sample = bpe_vocab_size(g.tok);
        rc = qt_decoder_init(&g.d, m, g.ctx, g.max_ctx, max_new, v_sample);
        g.d.model_dir = model;
        g.d.adapter = adapter;
        g.d.so = so;
        g.d.seed = seed;
        qt_rng_seed(&g.d.rng, seed);
    }
    if (rc == QT_OK) {
        int32_t im_end = g.tok ? bpe_token_id(g.tok, "<|im_end|>") : -1;
        int32_t eot = g.tok ? bpe_token_id(g.tok, "<|endoftext|>") : -1;
        qt_decoder_add_stop(&g.d, im_end);
        qt_decoder_add_stop(&g.d, eot);
        for (int k = 0; k < n_eos; k++) qt_decoder_add_stop(&g.d, eos[k]);
        if (chat) {
            if (!g.tok) rc = QT_ERR(QT_EINVAL, "--chat needs the model's tokenizer.json in %s", model);
            else {
                warn_untrained_chat(model, adapter, im_end);
                rc = chat_loop(&g, system);
            }
        } else if (prompts_file) {
            rc = qt_decode_batch(&g.d, prompts, n_prompts, batch, print_reply, &g);
        } else {
            rc = generate_reply(&g, ids, (int)n_ids);
        }
    }
    /* the speeds, on stderr so stdout stays the text (or the JSON lines): prompt tokens run through
     * the batched forward per second, and one-token decode steps (each with its sampling) per second */
    const qt_decoder *d = &g.d;
    if (rc == QT_OK && d->prompt_tokens > 0 && !prompts_file)
        qt_info("prompt %ld tokens, %.1f tok/s; decode %ld tokens, %.1f tok/s", d->prompt_tokens,
                d->prompt_s > 0 ? d->prompt_tokens / d->prompt_s : 0.0, d->decode_tokens,
                d->decode_s > 0 ? d->decode_tokens / d->decode_s : 0.0);
    if (rc == QT_OK && prompts_file) /* decode: tokens of all the sequences per second of the steps */
        qt_info("%d prompts, batch %d: prompt %ld tokens, %.1f tok/s; decode %ld tokens, %.1f tok/s", n_prompts,
                batch, d->prompt_tokens, d->prompt_s > 0 ? d->prompt_tokens / d->prompt_s : 0.0, d->decode_tokens,
                d->decode_s > 0 ? d->decode_tokens / d->decode_s : 0.0);
    free_prompts(prompts, n_prompts);
    qt_free(ids);
    qt_decoder_free(&g.d);
    qt_free(g.reply);
    qt_model_free(m);
    bpe_free(g.tok);
    return rc == QT_OK ? QT_EXIT_OK : cli_fail();
}
