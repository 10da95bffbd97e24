/* Model folder and PEFT adapter -> GGUF (see gguf_export.h). The metadata
 * follows llama.cpp's convert_hf_to_gguf.py for these architectures: the
 * hyperparameters under "<arch>.", the byte-level BPE vocabulary (from
 * tokenizer.json, or the original Qwen's qwen.tiktoken as its QwenModel reads it) under
 * "tokenizer.ggml." (every id below vocab_size, ids with no token as
 * "[PAD<id>]" of type UNUSED, added tokens CONTROL when special or spelled
 * like a control token (<|...|>), else USER_DEFINED), merges as "a b" strings, special ids and the chat template. */
#include "export/gguf_export.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "io/bnb4.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "text/tokenizer.h"

/* ---- tensor names, one table per architecture ----------------------------------- */
typedef struct {
    const char *hf, *gguf;
    char permute; /* 'q' / 'k': rows permuted to ggml's interleaved RoPE (rope_interleaved archs) */
} name_row;

static const name_row llama_family_global[] = {
    {"model.embed_tokens.weight", "token_embd.weight", 0},
    {"model.norm.weight", "output_norm.weight", 0},
    {"lm_head.weight", "output.weight", 0},
};
/* after "model.layers.N." */
static const name_row llama_family_layer[] = {
    {"input_layernorm.weight", "attn_norm.weight", 0},
    {"self_attn.q_proj.weight", "attn_q.weight", 'q'},
    {"self_attn.q_proj.bias", "attn_q.bias", 'q'},
    {"self_attn.k_proj.weight", "attn_k.weight", 'k'},
    {"self_attn.k_proj.bias", "attn_k.bias", 'k'},
    {"self_attn.v_proj.weight", "attn_v.weight", 0},
    {"self_attn.v_proj.bias", "attn_v.bias", 0},
    {"self_attn.o_proj.weight", "attn_output.weight", 0},
    {"post_attention_layernorm.weight", "ffn_norm.weight", 0},
    {"mlp.gate_proj.weight", "ffn_gate.weight", 0},
    {"mlp.up_proj.weight", "ffn_up.weight", 0},
    {"mlp.down_proj.weight", "ffn_down.weight", 0},
    {"self_attn.q_norm.weight", "attn_q_norm.weight", 0}, /* Qwen3: RMSNorm over head_dim on q and k */
    {"self_attn.k_norm.weight", "attn_k_norm.weight", 0},
};

/* The original Qwen (QWenLMHeadModel): llama.cpp's arch "qwen" keeps c_attn fused
 * (attn_qkv, rows q, k, v) and names mlp.w2 the gate (modeling_qwen.py: w1(x) * silu(w2(x))) */
static const name_row qwen1_global[] = {
    {"transformer.wte.weight", "token_embd.weight", 0},
    {"transformer.ln_f.weight", "output_norm.weight", 0},
    {"lm_head.weight", "output.weight", 0},
};
/* after "transformer.h.N." */
static const name_row qwen1_layer[] = {
    {"ln_1.weight", "attn_norm.weight", 0},
    {"attn.c_attn.weight", "attn_qkv.weight", 0},
    {"attn.c_attn.bias", "attn_qkv.bias", 0},
    {"attn.c_proj.weight", "attn_output.weight", 0},
    {"ln_2.weight", "ffn_norm.weight", 0},
    {"mlp.w1.weight", "ffn_up.weight", 0},
    {"mlp.w2.weight", "ffn_gate.weight", 0},
    {"mlp.c_proj.weight", "ffn_down.weight", 0},
};

typedef struct {
    qt_arch arch;
    const char *name; /* general.architecture, and the prefix of its hyperparameter keys */
    const name_row *global, *layer;
    int n_global, n_layer;
    int rope_interleaved; /* ggml's RoPE for this arch pairs (2i, 2i+1); HF's pairs (i, i + D/2) */
    const char *layers;   /* the prefix of layer N's names: "<layers>N." */
    int qwen1;            /* feed_forward_length is the config's doubled intermediate_size (llama.cpp
                           * halves it), and output.weight is required (a tied model writes it twice) */
} arch_map;

#define N_OF(a) (int)(sizeof(a) / sizeof((a)[0]))
static const arch_map arch_maps[] = {
    {QT_ARCH_QWEN2, "qwen2", llama_family_global, llama_family_layer, N_OF(llama_family_global),
     N_OF(llama_family_layer), 0, "model.layers.", 0},
    {QT_ARCH_QWEN3, "qwen3", llama_family_global, llama_family_layer, N_OF(llama_family_global),
     N_OF(llama_family_layer), 0, "model.layers.", 0},
    {QT_ARCH_LLAMA, "llama", llama_family_global, llama_family_layer, N_OF(llama_family_global),
     N_OF(llama_family_layer), 1, "model.layers.", 0},
    {QT_ARCH_QWEN, "qwen", qwen1_global, qwen1_layer, N_OF(qwen1_global), N_OF(qwen1_layer), 0, "transformer.h.", 1},
};

static const arch_map *find_arch(int arch) {
    for (int i = 0; i < N_OF(arch_maps); i++)
        if ((int)arch_maps[i].arch == arch) return &arch_maps[i];
    return NULL;
}

int gguf_tensor_name(int arch, const char *hf, int n_head, int n_head_kv, char *out, size_t cap, int *permute) {
    const arch_map *a = find_arch(arch);
    if (!a) return QT_ERR(QT_EUNSUPPORTED, "GGUF export does not know this model architecture (id %d)", arch);
    *permute = 0;
    const name_row *row = NULL;
    int layer = -1;
    for (int i = 0; i < a->n_global && !row; i++)
        if (!strcmp(hf, a->global[i].hf)) row = &a->global[i];
    const size_t lp = strlen(a->layers);
    const char *p = hf + lp;
    if (!row && !strncmp(hf, a->layers, lp) && *p >= '0' && *p <= '9') {
        char *end;
        long l = strtol(p, &end, 10);
        if (*end == '.' && l >= 0 && l < 100000)
            for (int i = 0; i < a->n_layer && !row; i++)
                if (!strcmp(end + 1, a->layer[i].hf)) row = &a->layer[i], layer = (int)l;
    }
    if (!row)
        return QT_ERR(QT_EUNSUPPORTED, "tensor %s has no GGUF name for the %s architecture; qtune exports the "
                      "weights of its Qwen2/Qwen3/Llama/original-Qwen layouts only", hf, a->name);
    int n = layer < 0 ? snprintf(out, cap, "%s", row->gguf) : snprintf(out, cap, "blk.%d.%s", layer, row->gguf);
    if (n < 0 || (size_t)n >= cap) return QT_ERR(QT_EINVAL, "GGUF name of %s is too long", hf);
    if (a->rope_interleaved && row->permute) *permute = row->permute == 'q' ? n_head : n_head_kv;
    return QT_OK;
}

/* ---- value producers -------------------------------------------------------------- */
static int stored_fill(void *ctx, float *dst, size_t off, size_t n) { return st_read_f32_range(ctx, off, n, dst); }

/* Any producer, then the mapped pages of the source range it has consumed are
 * handed back (the mapping is read-only, so they are only re-read from the
 * page cache if needed again): the resident size stays a few MiB instead of
 * growing to the whole model as the export walks it. */
typedef struct {
    st_fill_fn fill;
    void *ctx;
    const st_tensor *src;
} release_ctx;

static int release_fill(void *c, float *dst, size_t off, size_t n) {
    const release_ctx *r = c;
    QT_TRY(r->fill(r->ctx, dst, off, n));
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), es = qt_dtype_size(r->src->dtype),
                    p = (uintptr_t)r->src->data, a = (p + off * es + pg - 1) & ~(pg - 1),
                    e = (p + (off + n) * es) & ~(pg - 1);
    if (e > a) madvise((void *)a, e - a, MADV_DONTNEED);
    return QT_OK;
}

/* Rows of a (heads * D, cols) tensor in ggml's RoPE order: GGUF row h*D + 2j + s
 * is HF row h*D + s*D/2 + j (convert_hf_to_gguf.py's LlamaModel.permute). */
typedef struct {
    st_fill_fn fill;
    void *ctx;
    size_t D, cols;
} permute_ctx;

static int permuted_fill(void *c, float *dst, size_t off, size_t n) {
    const permute_ctx *p = c;
    /* whole rows arrive together when a row fits a chunk; else one element at a time */
    size_t step = off % p->cols == 0 && n % p->cols == 0 ? p->cols : 1;
    for (size_t e = off; e < off + n; e += step) {
        size_t r = e / p->cols, i = r % p->D;
        size_t src = (r - i + (i % 2) * (p->D / 2) + i / 2) * p->cols + e % p->cols;
        QT_TRY(p->fill(p->ctx, dst + (e - off), src, step));
    }
    return QT_OK;
}

/* ---- the tokenizer ------------------------------------------------------------------ */
enum { TOK_NORMAL = 1, TOK_UNKNOWN = 2, TOK_CONTROL = 3, TOK_USER_DEFINED = 4, TOK_UNUSED = 5 };

/* llama.cpp picks its pre-tokenizer by name; these are the Split regexes the
 * names stand for (tokenizer.json's pre_tokenizer). */
static const struct {
    const char *regex, *pre;
} pre_names[] = {
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "qwen2"},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
     "|\\s+(?!\\S)|\\s+",
     "llama-bpe"},
};

/* convert_hf_to_gguf.py's does_token_look_special: an added token that is not
 * marked special but reads like a control token is typed CONTROL all the same
 * (Qwen2.5 ships <|fim_prefix|> ... <|file_sep|> with "special": false, and a
 * USER_DEFINED token spelled <|...|> draws a "control-looking token" warning
 * on every llama.cpp load). */
static int looks_special(const char *t) {
    static const char *const named[] = {"<pad>", "<mask>", "<2mass>", "[@BOS@]"};
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (!strcmp(t, named[i])) return 1;
    const size_t n = strlen(t);
#define ENDS(s) (n >= strlen(s) && !strcmp(t + n - strlen(s), s))
    if (!strncmp(t, "<|", 2) && ENDS("|>")) return 1;
    if (!strncmp(t, "<\xef\xbd\x9c", 4) && ENDS("\xef\xbd\x9c>")) return 1; /* fullwidth bars, deepseek-coder */
    if (!strncmp(t, "<unused", 7) && ENDS(">")) return 1;
#undef ENDS
    return 0;
}

static const char *split_regex(const cJSON *pre) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(pre, "type");
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "Split")) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(pre, "pattern"), "Regex");
        return cJSON_IsString(r) ? r->valuestring : NULL;
    }
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers"), *e;
    cJSON_ArrayForEach(e, seq) {
        const char *r = split_regex(e);
        if (r) return r;
    }
    return NULL;
}

/* The id of a token string in the tokenizer's vocab or added tokens; -1 if none. */
static int token_id(const cJSON *vocab, const cJSON *added, const char *s) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(vocab, s), *e;
    if (cJSON_IsNumber(v)) return v->valueint;
    cJSON_ArrayForEach(e, added) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content"), *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (cJSON_IsString(c) && cJSON_IsNumber(id) && !strcmp(c->valuestring, s)) return id->valueint;
    }
    return -1;
}

/* tokenizer_config.json's "eos_token" etc.: a string or {"content": ...}. */
static const char *config_token(const cJSON *tc, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(tc, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static cJSON *read_json(const char *dir, const char *name, int required, int *rc) {
    char path[4096];
    *rc = qt_path_join(path, sizeof path, dir, name);
    if (*rc != QT_OK) return NULL;
    if (!qt_path_exists(path)) {
        if (required)
            *rc = QT_ERR(QT_EIO, "%s is missing; GGUF files carry the tokenizer, so the model folder needs its "
                         "tokenizer.json (or, for the original Qwen, its qwen.tiktoken)", path);
        return NULL;
    }
    char *text;
    if ((*rc = qt_read_file(path, (size_t)1 << 30, &text, NULL)) != QT_OK) return NULL;
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        *rc = QT_ERR(QT_EFORMAT, "%s is not a JSON object; fix or replace it", path);
        return NULL;
    }
    return j;
}

/* The vocabulary, merges, special ids and chat template: from tokenizer.json, or
 * from a folder's qwen.tiktoken (the original Qwen, which has none) as the
 * tokenizer.json tree it stands for, with the converter's one merge per token. */
static int add_tokenizer(gguf_writer *w, const char *dir, const qt_config *cfg) {
    int rc = QT_OK;
    char file[4096];
    const int tiktoken = bpe_folder_file(dir, file, sizeof file) && bpe_is_tiktoken_file(file); /* tokenizer.json first */
    cJSON *tj = NULL;
    if (tiktoken) rc = bpe_tiktoken_gguf_tree(file, &tj);
    else tj = read_json(dir, "tokenizer.json", 1, &rc);
    if (!tj) return rc;
    cJSON *tc = read_json(dir, "tokenizer_config.json", 0, &rc);
    const int V = cfg->vocab_size;
    char **tokens = qt_calloc((size_t)V, sizeof *tokens, "GGUF token list");
    int32_t *types = qt_malloc((size_t)V * sizeof *types, "GGUF token types");
    char **merges = NULL;
    size_t n_merges = 0;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(tj, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(tj, "added_tokens");
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (rc == QT_OK && (!tokens || !types)) rc = QT_ENOMEM;
    if (rc == QT_OK && (!cJSON_IsObject(vocab) || !cJSON_IsString(mtype) || strcmp(mtype->valuestring, "BPE")))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s/tokenizer.json: model is not a byte-level BPE with a vocab; GGUF export "
                    "writes the gpt2-style tokenizer Qwen and Llama 3 use", dir);
    /* the vocabulary, then the added tokens over it */
    const cJSON *e;
    if (rc == QT_OK) cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= V) {
            rc = QT_ERR(QT_EFORMAT, "%s/tokenizer.json: token %.40s has id %g, outside the model's vocab_size %d", dir,
                        e->string, cJSON_IsNumber(e) ? e->valuedouble : -1.0, V);
            break;
        }
        tokens[e->valueint] = e->string;
        types[e->valueint] = TOK_NORMAL;
    }
    if (rc == QT_OK) cJSON_ArrayForEach(e, added) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content"), *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsString(c) || !cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= V) {
            rc = QT_ERR(QT_EFORMAT, "%s/tokenizer.json: an added token has no content or an id outside the model's "
                        "vocab_size %d", dir, V);
            break;
        }
        tokens[id->valueint] = c->valuestring;
        types[id->valueint] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "special")) || looks_special(c->valuestring)
                                  ? TOK_CONTROL
                                  : TOK_USER_DEFINED;
    }
    char (*pads)[24] = NULL;
    if (rc == QT_OK && !(pads = qt_malloc((size_t)V * sizeof *pads, "GGUF pad tokens"))) rc = QT_ENOMEM;
    for (int i = 0; rc == QT_OK && i < V; i++)
        if (!tokens[i]) {
            snprintf(pads[i], sizeof pads[i], "[PAD%d]", i);
            tokens[i] = pads[i];
            types[i] = TOK_UNUSED;
        }
    /* merges: "a b" strings (older files) or ["a", "b"] pairs */
    const cJSON *ml = cJSON_GetObjectItemCaseSensitive(model, "merges");
    int nm = cJSON_GetArraySize(ml);
    if (rc == QT_OK && nm > 0 && !(merges = qt_calloc((size_t)nm, sizeof *merges, "GGUF merges"))) rc = QT_ENOMEM;
    if (rc == QT_OK) cJSON_ArrayForEach(e, ml) {
        if (cJSON_IsString(e)) {
            merges[n_merges] = qt_strdup(e->valuestring);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            const char *a = cJSON_GetArrayItem(e, 0)->valuestring, *b = cJSON_GetArrayItem(e, 1)->valuestring;
            size_t n = strlen(a) + strlen(b) + 2;
            if ((merges[n_merges] = qt_malloc(n, "a merge"))) snprintf(merges[n_merges], n, "%s %s", a, b);
        } else {
            rc = QT_ERR(QT_EFORMAT, "%s/tokenizer.json: merge %zu is neither \"a b\" nor [\"a\", \"b\"]", dir,
                        n_merges + 1);
            break;
        }
        if (!merges[n_merges++]) rc = QT_ENOMEM;
    }
    const char *regex = split_regex(cJSON_GetObjectItemCaseSensitive(tj, "pre_tokenizer")), *pre = NULL;
    for (int i = 0; regex && i < N_OF(pre_names); i++)
        if (!strcmp(regex, pre_names[i].regex)) pre = pre_names[i].pre;
    if (rc == QT_OK && !pre)
        rc = QT_ERR(QT_EUNSUPPORTED, "%s/tokenizer.json: its pre-tokenizer split regex is neither Qwen2's nor Llama "
                    "3's, and llama.cpp names its pre-tokenizers; GGUF export supports those two", dir);
    if (rc == QT_OK) rc = gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    if (rc == QT_OK) rc = gguf_set_str(w, "tokenizer.ggml.pre", pre);
    if (rc == QT_OK) rc = gguf_set_str_array(w, "tokenizer.ggml.tokens", (const char *const *)tokens, (size_t)V);
    if (rc == QT_OK) rc = gguf_set_i32_array(w, "tokenizer.ggml.token_type", types, (size_t)V);
    if (rc == QT_OK) rc = gguf_set_str_array(w, "tokenizer.ggml.merges", (const char *const *)merges, n_merges);
    /* special ids as convert_hf_to_gguf's SpecialVocab finds them: tokenizer_config.json's
     * tokens, else config.json's ids */
    int bos = -1, eos = -1, pad = -1;
    const char *s;
    if ((s = config_token(tc, "bos_token"))) bos = token_id(vocab, added, s);
    if ((s = config_token(tc, "eos_token"))) eos = token_id(vocab, added, s);
    if ((s = config_token(tc, "pad_token"))) pad = token_id(vocab, added, s);
    if (bos < 0) bos = cfg->bos_token_id;
    if (eos < 0) eos = cfg->eos_token_id;
    /* _set_vocab_qwen: with no special id from the configs, bos and eos are <|endoftext|>; unk is, always */
    const int unk = tiktoken ? token_id(vocab, added, "<|endoftext|>") : -1;
    if (tiktoken && bos < 0 && eos < 0 && pad < 0) bos = eos = unk;
    if (rc == QT_OK && unk >= 0 && unk < V) rc = gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", (uint32_t)unk);
    if (rc == QT_OK && bos >= 0 && bos < V) rc = gguf_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
    if (rc == QT_OK && eos >= 0 && eos < V) rc = gguf_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
    if (rc == QT_OK && pad >= 0 && pad < V) rc = gguf_set_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)pad);
    /* qtune (like Qwen's tokenizer) adds no BOS unless the config asks */
    if (rc == QT_OK)
        rc = gguf_set_bool(w, "tokenizer.ggml.add_bos_token",
                           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(tc, "add_bos_token")));
    /* the template qtune trains and chats with (text/chat_template.h): the folder's chat_template.jinja, else
     * tokenizer_config.json's, else the ChatML qtune renders for a folder without one, so that llama.cpp
     * serves the model under the prompt format it was trained on */
    char jpath[4096], *jtext = NULL;
    size_t jlen = 0;
    if (rc == QT_OK && qt_path_join(jpath, sizeof jpath, dir, "chat_template.jinja") == QT_OK && qt_path_exists(jpath))
        rc = qt_read_file(jpath, (size_t)64 << 20, &jtext, &jlen);
    const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(tc, "chat_template");
    const char *chosen = jtext ? jtext : cJSON_IsString(tmpl) ? tmpl->valuestring
                       : tiktoken ? qt_qwen_chatml_template : qt_qwen25_chat_template;
    if (rc == QT_OK && cJSON_IsArray(tmpl) && !jtext) /* [{name, template}]: the "default" one, as apply_chat_template */
        for (const cJSON *e = tmpl->child; e; e = e->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name"), *t = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default") && cJSON_IsString(t)) chosen = t->valuestring;
        }
    if (rc == QT_OK) rc = gguf_set_str(w, "tokenizer.chat_template", chosen);
    qt_free(jtext);
    for (size_t i = 0; merges && i < n_merges; i++) qt_free(merges[i]);
    qt_free(merges);
    qt_free(pads);
    qt_free(tokens);
    qt_free(types);
    cJSON_Delete(tc);
    cJSON_Delete(tj);
    return rc;
}

/* ---- metadata shared by the model and the adapter ---------------------------------- */
static void folder_name(const char *dir, char *out, size_t cap) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && dir[b - 1] != '/') b--;
    snprintf(out, cap, "%.*s", (int)(n - b), dir + b);
}

/* general.name: the folder's name, except for a training run's final/ or
 * checkpoint-STEP, which is named after the base model and the run
 * ("Qwen2.5-0.5B-myrun"): its qtune_run.json beside it records the job. */
static void model_name(const char *dir, char *out, size_t cap) {
    folder_name(dir, out, cap);
    if (strcmp(out, "final") && strncmp(out, "checkpoint-", 11)) return;
    char parent[4096], run[4200], base[256] = "", runname[256];
    qt_path_dirname(parent, sizeof parent, dir);
    folder_name(parent, runname, sizeof runname);
    char *text = NULL;
    snprintf(run, sizeof run, "%s/qtune_run.json", parent);
    if (qt_read_file(run, 1 << 24, &text, NULL) == QT_OK) {
        cJSON *j = cJSON_Parse(text);
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "job"), "model");
        if (cJSON_IsString(m)) folder_name(m->valuestring, base, sizeof base);
        cJSON_Delete(j);
        qt_free(text);
    } else {
        qt_error_clear();
    }
    if (base[0] && strcmp(base, ".") && strcmp(base, runname)) snprintf(out, cap, "%.120s-%.120s", base, runname);
    else if (runname[0] && strcmp(runname, ".")) snprintf(out, cap, "%s", runname);
}

static int add_general(gguf_writer *w, const arch_map *a, const char *type, const char *dir,
                       const gguf_export_opts *o) {
    char name[256];
    model_name(dir, name, sizeof name);
    QT_TRY(gguf_set_str(w, "general.architecture", a->name));
    QT_TRY(gguf_set_str(w, "general.type", type));
    return gguf_set_str(w, "general.name", o->name ? o->name : name);
}

static int add_hparams(gguf_writer *w, const arch_map *a, const qt_config *c) {
    char k[128];
#define KEY(s) (snprintf(k, sizeof k, "%s.%s", a->name, s), k)
    QT_TRY(gguf_set_u32(w, KEY("vocab_size"), (uint32_t)c->vocab_size));
    /* the original Qwen's dynamic NTK and logn scaling act past seq_length only; llama.cpp has neither,
     * so (as qtune) it is held to seq_length there */
    QT_TRY(gguf_set_u32(w, KEY("context_length"), (uint32_t)qt_config_max_positions(c)));
    QT_TRY(gguf_set_u32(w, KEY("embedding_length"), (uint32_t)c->hidden_size));
    QT_TRY(gguf_set_u32(w, KEY("block_count"), (uint32_t)c->num_hidden_layers));
    /* qtune keeps the original Qwen's MLP width (config.json's intermediate_size / 2); llama.cpp's "qwen"
     * takes the config's value and halves it, as the converter writes it */
    QT_TRY(gguf_set_u32(w, KEY("feed_forward_length"), (uint32_t)c->intermediate_size * (a->qwen1 ? 2u : 1u)));
    QT_TRY(gguf_set_u32(w, KEY("attention.head_count"), (uint32_t)c->num_attention_heads));
    QT_TRY(gguf_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)c->num_key_value_heads));
    QT_TRY(gguf_set_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim));
    QT_TRY(gguf_set_u32(w, KEY("attention.value_length"), (uint32_t)c->head_dim));
    QT_TRY(gguf_set_u32(w, KEY("rope.dimension_count"), (uint32_t)c->head_dim));
    QT_TRY(gguf_set_f32(w, KEY("rope.freq_base"), c->rope_theta));
    return gguf_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->rms_norm_eps);
#undef KEY
}

/* ---- RoPE scaling, as llama.cpp (c392e50) applies it ---------------------------------------
 * linear: "<arch>.rope.scaling.type" "linear" and the factor (freq_scale = 1 / factor).
 * yarn: type "yarn", the factor and original_context_length; ggml's YaRN ramps between the
 *   dimensions beta_fast = 32 and beta_slow = 1 turn over that length (floored and ceiled, as
 *   transformers' truncate), and scales cos/sin by attn_factor x (1 + 0.1 ln factor), so an
 *   attention factor of transformers' other than that default is written as attn_factor.
 *   llama.cpp has no keys for other betas or for truncate false: those are refused.
 * llama3: the "rope_freqs.weight" tensor (llama architecture only): per frequency the divisor
 *   transformers applies, as llama.cpp's converter computes it.
 * dynamic NTK: llama.cpp does not have it. */
static int rope_scaling_check(const char *dir, const qt_config *c, const arch_map *a) {
    const qt_rope_scaling *r = &c->rope_scaling;
    const char *why = NULL;
    if (r->type == QT_ROPE_DYNAMIC) why = "llama.cpp has no dynamic NTK scaling";
    else if (r->type == QT_ROPE_LLAMA3 && strcmp(a->name, "llama"))
        why = "llama.cpp reads llama3's frequency factors (rope_freqs) for the llama architecture only";
    else if (r->type == QT_ROPE_YARN && (r->beta_fast != 32.0f || r->beta_slow != 1.0f))
        why = "llama.cpp's YaRN keeps beta_fast 32 and beta_slow 1 (no GGUF key sets them)";
    else if (r->type == QT_ROPE_YARN && !r->truncate)
        why = "llama.cpp's YaRN truncates the correction range (truncate false has no GGUF key)";
    if (!why) return QT_OK;
    return QT_ERR(QT_EUNSUPPORTED, "%s/config.json: rope_scaling is %s, which GGUF export cannot write so that "
                  "llama.cpp runs the same model (%s); convert this model with llama.cpp's convert_hf_to_gguf.py "
                  "if its result suits you", dir, qt_rope_type_name(r->type), why);
}

static int add_rope_scaling(gguf_writer *w, const arch_map *a, const qt_config *c) {
    const qt_rope_scaling *r = &c->rope_scaling;
    if (r->type != QT_ROPE_LINEAR && r->type != QT_ROPE_YARN) return QT_OK;
    char k[128];
#define KEY(s) (snprintf(k, sizeof k, "%s.%s", a->name, s), k)
    const double factor = qt_rope_factor(c);
    QT_TRY(gguf_set_str(w, KEY("rope.scaling.type"), r->type == QT_ROPE_LINEAR ? "linear" : "yarn"));
    QT_TRY(gguf_set_f32(w, KEY("rope.scaling.factor"), (float)factor));
    if (r->type == QT_ROPE_YARN) {
        QT_TRY(gguf_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)qt_rope_original_length(c)));
        /* ggml multiplies attn_factor by its own 1 + 0.1 ln(factor) */
        const double attn = qt_rope_yarn_attention(c), ggml_ms = 1.0 + 0.1 * log(factor);
        if (fabs(attn - ggml_ms) > 1e-6 * ggml_ms)
            QT_TRY(gguf_set_f32(w, KEY("rope.scaling.attn_factor"), (float)(attn / ggml_ms)));
    }
    return QT_OK;
#undef KEY
}

/* llama3: rope_freqs[i] = the divisor of frequency i (1, factor, or the smooth mix between), as
 * convert_hf_to_gguf.py's LlamaModel writes it. */
static int rope_freqs_fill(void *ctx, float *dst, size_t offset, size_t n) {
    memcpy(dst, (const float *)ctx + offset, n * sizeof *dst);
    return QT_OK;
}

static void rope_freqs_compute(const qt_config *c, float *out) {
    const qt_rope_scaling *r = &c->rope_scaling;
    const int D = c->head_dim, half = D / 2;
    const double orig = qt_rope_original_length(c);
    const double lo_wl = orig / r->low_freq_factor, hi_wl = orig / r->high_freq_factor;
    for (int i = 0; i < half; i++) {
        const double freq = 1.0 / pow(c->rope_theta, (double)(2 * i) / D), wl = 2.0 * M_PI / freq;
        double d = 1.0;
        if (wl > lo_wl) d = r->factor;
        else if (!(wl < hi_wl)) {
            const double smooth = (orig / wl - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
            d = 1.0 / ((1.0 - smooth) / r->factor + smooth);
        }
        out[i] = (float)d;
    }
}

/* llama.cpp's LLAMA_FTYPE of a file whose 2-D weights are t */
static uint32_t file_type(gguf_type t) {
    switch (t) {
    case GGUF_F32: return 0;
    case GGUF_F16: return 1;
    case GGUF_Q8_0: return 7;
    case GGUF_BF16: return 32;
    }
    return 0;
}

static int load_config(const char *dir, qt_config *cfg, const arch_map **a) {
    QT_TRY(qt_config_load(dir, cfg));
    if (!(*a = find_arch((int)cfg->arch)))
        return QT_ERR(QT_EUNSUPPORTED, "%s/config.json: GGUF export writes Qwen2ForCausalLM, Qwen3ForCausalLM, "
                      "LlamaForCausalLM and QWenLMHeadModel models, not %s; convert it with llama.cpp's "
                      "convert_hf_to_gguf.py", dir, qt_arch_name(cfg->arch));
    return QT_OK;
}

/* A 4-bit weight of a bitsandbytes folder where the config expects shape:
 * its quant_state and parts checked (io/bnb4.h), and a producer of its
 * dequantized values given. */
static int q4_expect(const char *dir, st_file *st, const st_tensor *t, const int64_t *shape, st_fill_fn fill) {
    qt_q4_weight *q4;
    size_t bytes;
    QT_TRY(bnb4_read(st, dir, t, shape[0], shape[1], &q4, &bytes));
    qt_free(q4);
    if (!fill)
        return QT_ERR(QT_EUNSUPPORTED, "%s is a bitsandbytes 4-bit folder, and this writer has no dequantizing "
                      "source for %s; use qtune export, which writes it dequantized", dir, t->name);
    return QT_OK;
}

/* ---- the model ------------------------------------------------------------------------ */
int gguf_export_model(const char *model_dir, const char *out, const gguf_export_opts *o) {
    qt_config cfg;
    const arch_map *a;
    QT_TRY(load_config(model_dir, &cfg, &a));
    QT_TRY(rope_scaling_check(model_dir, &cfg, a));
    st_file *st = NULL;
    float *freqs = NULL; /* llama3's rope_freqs, read while the file is written */
    gguf_writer *w = NULL;
    const int nw = qt_weight_count(&cfg);
    permute_ctx *perm = qt_calloc((size_t)nw, sizeof *perm, "GGUF permutations");
    release_ctx *rel = qt_calloc((size_t)nw, sizeof *rel, "GGUF producers");
    int rc = perm && rel ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK && o->base) st = o->base;
    else if (rc == QT_OK) rc = st_open(model_dir, &st);
    if (rc == QT_OK) rc = gguf_writer_new(&w);
    if (rc == QT_OK) rc = add_general(w, a, "model", model_dir, o);
    if (rc == QT_OK) rc = gguf_set_u32(w, "general.file_type", file_type(o->type));
    if (rc == QT_OK) rc = gguf_set_u32(w, "general.quantization_version", 2);
    if (rc == QT_OK) rc = add_hparams(w, a, &cfg);
    if (rc == QT_OK) rc = add_rope_scaling(w, a, &cfg);
    if (rc == QT_OK && cfg.rope_scaling.type == QT_ROPE_LLAMA3) {
        const int64_t shape[1] = {cfg.head_dim / 2};
        freqs = qt_calloc((size_t)cfg.head_dim / 2 + 1, sizeof *freqs, "rope_freqs");
        rc = freqs ? QT_OK : QT_ENOMEM;
        if (rc == QT_OK) rope_freqs_compute(&cfg, freqs);
        if (rc == QT_OK) rc = gguf_add_tensor(w, "rope_freqs.weight", GGUF_F32, 1, shape, rope_freqs_fill, freqs);
    }
    if (rc == QT_OK) rc = add_tokenizer(w, model_dir, &cfg);
    int fallback = 0;
    st_fill_fn embd_fill = NULL; /* the embedding's producer, for a tied model that needs output.weight */
    void *embd_ctx = NULL;
    const st_tensor *embd = NULL;
    for (int i = 0; rc == QT_OK && i < nw; i++) {
        qt_weight_spec spec;
        const st_tensor *t;
        char gname[GGUF_MAX_NAME + 1];
        int heads;
        rc = qt_weight_spec_at(&cfg, i, &spec);
        st_fill_fn fill = NULL;
        void *ctx = NULL;
        if (rc == QT_OK && o->source) o->source(o->source_ctx, spec.name, &fill, &ctx);
        /* a bitsandbytes 4-bit weight: its values come dequantized from the source (qtune export sets one) */
        if (rc == QT_OK && cfg.prequant4 && (t = st_find(st, spec.name)) && bnb4_is_weight(st, t) && spec.ndim == 2)
            rc = q4_expect(model_dir, st, t, spec.shape, fill);
        else if (rc == QT_OK) rc = st_expect(st, spec.name, spec.ndim, spec.shape, &t);
        if (rc == QT_OK)
            rc = gguf_tensor_name((int)cfg.arch, spec.name, cfg.num_attention_heads, cfg.num_key_value_heads, gname,
                                  sizeof gname, &heads);
        if (rc != QT_OK) break;
        if (!fill) fill = stored_fill, ctx = (void *)t;
        if (heads) {
            perm[i] = (permute_ctx){fill, ctx, (size_t)cfg.head_dim, spec.ndim == 2 ? (size_t)spec.shape[1] : 1};
            fill = permuted_fill, ctx = &perm[i];
        }
        if (!o->source || o->base) { /* the pages the producer reads are t's (a source reads o->base) */
            rel[i] = (release_ctx){fill, ctx, t};
            fill = release_fill, ctx = &rel[i];
        }
        gguf_type type = spec.ndim == 1 ? GGUF_F32 : o->type;
        if (type == GGUF_Q8_0 && spec.shape[spec.ndim - 1] % GGUF_QK8_0) type = GGUF_F16, fallback++;
        rc = gguf_add_tensor(w, gname, type, spec.ndim, spec.shape, fill, ctx);
        if (!strcmp(gname, "token_embd.weight")) embd_fill = fill, embd_ctx = ctx, embd = t;
    }
    /* llama.cpp's "qwen" requires output.weight (it has no tied fallback): the embedding again */
    if (rc == QT_OK && a->qwen1 && cfg.tie_word_embeddings && embd) {
        gguf_type type = o->type == GGUF_Q8_0 && embd->shape[1] % GGUF_QK8_0 ? GGUF_F16 : o->type;
        rc = gguf_add_tensor(w, "output.weight", type, 2, embd->shape, embd_fill, embd_ctx);
    }
    if (rc == QT_OK && fallback)
        qt_warn("%d weights have rows that are not a multiple of 32 long and are stored as f16 instead of q8_0",
                fallback);
    if (rc == QT_OK) {
        gguf_writer_set_stop(w, o->stop);
        gguf_writer_set_progress(w, o->progress, o->tty);
        rc = gguf_writer_write(w, out);
    }
    gguf_writer_free(w);
    if (st != o->base) st_close(st);
    qt_free(perm);
    qt_free(rel);
    qt_free(freqs);
    return rc;
}

/* ---- the LoRA adapter ------------------------------------------------------------------ */
int gguf_export_lora(const char *model_dir, const char *adapter_dir, const char *out, const gguf_export_opts *o) {
    qt_config cfg;
    const arch_map *a;
    QT_TRY(load_config(model_dir, &cfg, &a));
    if (o->type == GGUF_Q8_0)
        return QT_ERR(QT_EINVAL, "--gguf-lora writes f32, f16 or bf16 (LoRA B's rows are r long, too short for "
                      "q8_0 blocks); drop --dtype q8_0");
    peft_config pc;
    QT_TRY(peft_config_load(adapter_dir, &pc));
    st_file *ad = NULL;
    QT_TRY(peft_open_weights(adapter_dir, &ad));
    gguf_writer *w = NULL;
    const int n = st_count(ad);
    permute_ctx *perm = qt_calloc((size_t)(n > 0 ? n : 1), sizeof *perm, "GGUF permutations");
    int rc = perm ? gguf_writer_new(&w) : QT_ENOMEM;
    if (rc == QT_OK) rc = add_general(w, a, "adapter", adapter_dir, o);
    if (rc == QT_OK) rc = gguf_set_str(w, "adapter.type", "lora");
    /* llama.cpp scales by alpha / r (r = lora_a's ne[1]); rsLoRA's alpha / sqrt(r) is alpha * sqrt(r) / r */
    if (rc == QT_OK)
        rc = gguf_set_f32(w, "adapter.lora.alpha", pc.use_rslora ? pc.lora_alpha * sqrtf((float)pc.r) : pc.lora_alpha);
    for (int i = 0; rc == QT_OK && i < n; i++) {
        const st_tensor *t = st_at(ad, i);
        char base[512], gname[GGUF_MAX_NAME + 1], full[GGUF_MAX_NAME + 16];
        int is_b, heads;
        if (!peft_base_name(t->name, base, sizeof base, &is_b) || t->ndim != 2) {
            rc = QT_ERR(QT_EUNSUPPORTED, "%s: tensor %s is not a LoRA A/B matrix (a modules_to_save weight?); "
                        "llama.cpp's LoRA GGUF holds A/B matrices only, so export the merged model with --gguf",
                        adapter_dir, t->name);
            break;
        }
        rc = gguf_tensor_name((int)cfg.arch, base, cfg.num_attention_heads, cfg.num_key_value_heads, gname,
                              sizeof gname, &heads);
        if (rc != QT_OK) break;
        snprintf(full, sizeof full, "%s.%s", gname, is_b ? "lora_b" : "lora_a");
        st_fill_fn fill = stored_fill;
        void *ctx = (void *)t;
        if (heads && is_b) { /* B's rows are W's output rows: the same permutation */
            perm[i] = (permute_ctx){fill, ctx, (size_t)cfg.head_dim, (size_t)t->shape[1]};
            fill = permuted_fill, ctx = &perm[i];
        }
        rc = gguf_add_tensor(w, full, o->type, 2, t->shape, fill, ctx);
    }
    if (rc == QT_OK) {
        gguf_writer_set_stop(w, o->stop);
        gguf_writer_set_progress(w, o->progress, o->tty);
        rc = gguf_writer_write(w, out);
    }
    gguf_writer_free(w);
    qt_free(perm);
    st_close(ad);
    return rc;
}
