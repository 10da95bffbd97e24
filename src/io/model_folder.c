/* Writing a Hugging Face model folder: initial weights, generation_config.json,
 * tokenizer files. See model_folder.h. */
#include "io/model_folder.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/progress.h"
#include "core/rng.h"
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* transformers' PretrainedConfig.initializer_range for Qwen2 and Llama, used
 * when the config gives none. */
#define INIT_STD 0.02f
#define TOKENIZER_MAX_BYTES ((size_t)64 << 20)
#define GEN_TRANSFORMERS_VERSION "4.43.1"

/* The original Qwen-Chat's ChatML (qwen_generation_utils.make_context) as a
 * template: Qwen2-Instruct's, whose layout and default system prompt are the
 * same. What a qwen.tiktoken folder, which ships no template, trains with. */
const char qt_qwen_chatml_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const char qt_qwen25_chat_template[] =
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

/* ---------------------------------------------------------------------------
 * Weight names and shapes */

/* One layer's tensors, in write order, named by the architecture's layout
 * (qt_config_layout): the q/k/v biases exist only with attention_bias,
 * q_norm/k_norm only in Qwen3, and a fused q/k/v (original Qwen) is one
 * c_attn of (H + 2 KV) D rows. Returns the count (at most 16). */
typedef struct {
    const char *what; /* module path, without the layer prefix */
    const char *kind_s; /* "weight" or "bias" */
    int ndim;
    int64_t d0, d1;
    qt_init_kind init;
} layer_slot;

static int layer_slots(const qt_config *c, layer_slot *s) {
    const qt_layout *ly = qt_config_layout(c);
    int64_t C = c->hidden_size, I = c->intermediate_size, D = c->head_dim;
    int64_t q = (int64_t)c->num_attention_heads * D, kv = (int64_t)c->num_key_value_heads * D;
    int n = 0;
#define SLOT(w, k, nd, a, b, in) (s[n++] = (layer_slot){(w), (k), (nd), (a), (b), (in)})
    SLOT(ly->ln1, "weight", 1, C, 0, QT_INIT_ONES);
    if (ly->fused_qkv) {
        SLOT(ly->lin[0], "weight", 2, q + 2 * kv, C, QT_INIT_NORMAL);
        if (c->attention_bias) SLOT(ly->lin[0], "bias", 1, q + 2 * kv, 0, QT_INIT_ZEROS);
    } else {
        const int64_t rows[3] = {q, kv, kv};
        for (int j = 0; j < 3; j++) {
            SLOT(ly->lin[j], "weight", 2, rows[j], C, QT_INIT_NORMAL);
            if (c->attention_bias) SLOT(ly->lin[j], "bias", 1, rows[j], 0, QT_INIT_ZEROS);
        }
    }
    if (ly->q_norm) {
        SLOT(ly->q_norm, "weight", 1, D, 0, QT_INIT_ONES);
        SLOT(ly->k_norm, "weight", 1, D, 0, QT_INIT_ONES);
    }
    SLOT(ly->lin[3], "weight", 2, C, q, QT_INIT_NORMAL);
    SLOT(ly->ln2, "weight", 1, C, 0, QT_INIT_ONES);
    SLOT(ly->lin[4], "weight", 2, I, C, QT_INIT_NORMAL);
    SLOT(ly->lin[5], "weight", 2, I, C, QT_INIT_NORMAL);
    SLOT(ly->lin[6], "weight", 2, C, I, QT_INIT_NORMAL);
#undef SLOT
    return n;
}

static int per_layer(const qt_config *c) {
    layer_slot s[16];
    return layer_slots(c, s);
}

int qt_weight_count(const qt_config *c) {
    return 1 + c->num_hidden_layers * per_layer(c) + 1 + (c->tie_word_embeddings ? 0 : 1);
}

static void spec(qt_weight_spec *w, const char *name, int ndim, int64_t d0, int64_t d1, qt_init_kind k) {
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    w->shape[0] = d0;
    w->shape[1] = ndim > 1 ? d1 : 0;
    w->init = k;
}

int qt_weight_spec_at(const qt_config *c, int i, qt_weight_spec *w) {
    int64_t C = c->hidden_size, V = c->vocab_size;
    const qt_layout *ly = qt_config_layout(c);
    layer_slot slots[16];
    int pl = layer_slots(c, slots), n = qt_weight_count(c);
    char name[96];
    if (i < 0 || i >= n) return QT_ERR(QT_EINVAL, "weight index %d is outside the model's %d tensors", i, n);
    if (i == 0) {
        snprintf(name, sizeof name, "%s.weight", ly->embed);
        spec(w, name, 2, V, C, QT_INIT_NORMAL);
        return QT_OK;
    }
    int li = i - 1;
    if (li >= c->num_hidden_layers * pl) {
        snprintf(name, sizeof name, "%s.weight", ly->final_norm);
        if (li == c->num_hidden_layers * pl) spec(w, name, 1, C, 0, QT_INIT_ONES);
        else spec(w, "lm_head.weight", 2, V, C, QT_INIT_NORMAL);
        return QT_OK;
    }
    const layer_slot *sl = &slots[li % pl];
    snprintf(name, sizeof name, "%s.%d.%s.%s", ly->layers, li / pl, sl->what, sl->kind_s);
    spec(w, name, sl->ndim, sl->d0, sl->d1, sl->init);
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * Initial weights, produced while the writer streams them out */

typedef struct {
    qt_init_kind kind;
    float std;
    qt_progress *prog; /* NULL: silent; done counts parameters written */
    qt_rng rng;
    int have_spare; /* Box-Muller makes normals in pairs; the second waits here */
    float spare;
} init_stream;

static float init_normal(init_stream *s) {
    if (s->have_spare) {
        s->have_spare = 0;
        return s->spare;
    }
    float u1 = qt_rng_uniform(&s->rng), u2 = qt_rng_uniform(&s->rng);
    if (u1 < 1e-12f) u1 = 1e-12f;
    float r = sqrtf(-2.0f * logf(u1)), a = 6.2831853071795864f * u2;
    s->spare = r * sinf(a);
    s->have_spare = 1;
    return r * cosf(a);
}

static int fill_init(void *ctx, float *dst, size_t offset, size_t n) {
    init_stream *s = ctx;
    (void)offset; /* the writer asks in order, so the stream just continues */
    switch (s->kind) {
    case QT_INIT_ZEROS: memset(dst, 0, n * sizeof *dst); break;
    case QT_INIT_ONES: for (size_t i = 0; i < n; i++) dst[i] = 1.0f; break;
    default: for (size_t i = 0; i < n; i++) dst[i] = s->std * init_normal(s); break;
    }
    if (s->prog) qt_progress_set(s->prog, s->prog->done + (double)n);
    return QT_OK;
}

int qt_init_weights_write(const qt_config *c, qt_dtype dtype, uint64_t seed, const char *path) {
    return qt_init_weights_write_progress(c, dtype, seed, path, NULL);
}

int qt_init_weights_write_progress(const qt_config *c, qt_dtype dtype, uint64_t seed, const char *path,
                                   qt_progress *prog) {
    int n = qt_weight_count(c);
    init_stream *streams = qt_calloc((size_t)n, sizeof *streams, "the init streams");
    if (!streams) return QT_ENOMEM;
    st_writer *w = NULL;
    int rc = st_writer_new(&w);
    for (int i = 0; i < n && rc == QT_OK; i++) {
        qt_weight_spec ws;
        rc = qt_weight_spec_at(c, i, &ws);
        if (rc != QT_OK) break;
        streams[i].kind = ws.init;
        streams[i].prog = prog;
        streams[i].std = c->initializer_range > 0.0f ? c->initializer_range : INIT_STD;
        qt_rng_derive(&streams[i].rng, seed, qt_hash64(ws.name, strlen(ws.name), 0), 0);
        rc = st_writer_add_fn(w, ws.name, dtype, ws.ndim, ws.shape, fill_init, &streams[i]);
    }
    if (rc == QT_OK) rc = st_writer_write(w, path);
    st_writer_free(w);
    qt_free(streams);
    return rc;
}

/* ---------------------------------------------------------------------------
 * generation_config.json */

int qt_generation_config_write(const qt_config *c, const char *dir) {
    char path[4096], buf[512];
    QT_TRY(qt_path_join(path, sizeof path, dir, "generation_config.json"));
    size_t k = 0;
    k += (size_t)snprintf(buf + k, sizeof buf - k, "{\n");
    if (c->bos_token_id >= 0) k += (size_t)snprintf(buf + k, sizeof buf - k, "  \"bos_token_id\": %d,\n", c->bos_token_id);
    k += (size_t)snprintf(buf + k, sizeof buf - k, "  \"do_sample\": false,\n");
    if (c->eos_token_id >= 0) k += (size_t)snprintf(buf + k, sizeof buf - k, "  \"eos_token_id\": %d,\n", c->eos_token_id);
    if (c->bos_token_id >= 0) k += (size_t)snprintf(buf + k, sizeof buf - k, "  \"pad_token_id\": %d,\n", c->bos_token_id);
    k += (size_t)snprintf(buf + k, sizeof buf - k, "  \"transformers_version\": \"" GEN_TRANSFORMERS_VERSION "\"\n}\n");
    return qt_write_file_atomic(path, buf, k);
}

/* ---------------------------------------------------------------------------
 * Tokenizer files */

static int json_id(const cJSON *v, int *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e9 || v->valuedouble != (double)(int)v->valuedouble)
        return 0;
    *out = (int)v->valuedouble;
    return 1;
}

static int read_tokenizer(const char *path, cJSON **root_out, qt_tokenizer_ids *ids) {
    ids->endoftext = ids->im_start = ids->im_end = ids->max_id = -1;
    char *text;
    QT_TRY(qt_read_file(path, TOKENIZER_MAX_BYTES, &text, NULL));
    cJSON *root = cJSON_Parse(text);
    qt_free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object; pass a Hugging Face tokenizer.json", path);
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s has no object 'model.vocab'; pass a Hugging Face BPE tokenizer.json", path);
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        int id;
        if (!json_id(e, &id)) {
            cJSON_Delete(root);
            return QT_ERR(QT_EFORMAT, "%s: model.vocab entry '%.40s' is not a token id", path, e->string);
        }
        if (id > ids->max_id) ids->max_id = id;
    }
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    cJSON_ArrayForEach(e, added) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        int id;
        if (!cJSON_IsString(content) || !json_id(cJSON_GetObjectItemCaseSensitive(e, "id"), &id)) {
            cJSON_Delete(root);
            return QT_ERR(QT_EFORMAT, "%s: an added_tokens entry lacks 'content' or 'id'", path);
        }
        if (id > ids->max_id) ids->max_id = id;
        if (!strcmp(content->valuestring, "<|endoftext|>")) ids->endoftext = id;
        else if (!strcmp(content->valuestring, "<|im_start|>")) ids->im_start = id;
        else if (!strcmp(content->valuestring, "<|im_end|>")) ids->im_end = id;
    }
    *root_out = root;
    return QT_OK;
}

int qt_tokenizer_ids_read(const char *path, qt_tokenizer_ids *ids) {
    cJSON *root = NULL;
    QT_TRY(read_tokenizer(path, &root, ids));
    cJSON_Delete(root);
    return QT_OK;
}

int qt_tokenizer_files_write(const qt_config *c, const char *tokenizer_json, const char *dir) {
    qt_tokenizer_ids ids;
    cJSON *tok = NULL;
    QT_TRY(read_tokenizer(tokenizer_json, &tok, &ids));
    int rc = QT_OK;
    if (ids.max_id >= c->vocab_size)
        rc = QT_ERR(QT_EINVAL, "%s has token ids up to %d but the model's vocab_size is %d; use a preset sized for this tokenizer (e.g. demo) or a config with a larger vocab_size",
                    tokenizer_json, ids.max_id, c->vocab_size);
    else if (ids.endoftext < 0 || ids.im_start < 0 || ids.im_end < 0)
        rc = QT_ERR(QT_EINVAL, "%s lacks <|endoftext|>, <|im_start|> or <|im_end|>; qtune init writes a ChatML tokenizer_config.json and needs a Qwen tokenizer",
                    tokenizer_json);
    cJSON *cfg = NULL;
    if (rc == QT_OK) {
        /* The special tokens the tokenizer itself marks special, for
         * skip_special_tokens; <|endoftext|> is already pad/eos. */
        cfg = cJSON_CreateObject();
        cJSON *extra = cJSON_CreateArray();
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(tok, "added_tokens")) {
            const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
            if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "special")) && strcmp(content->valuestring, "<|endoftext|>"))
                cJSON_AddItemToArray(extra, cJSON_CreateString(content->valuestring));
        }
        cJSON_AddFalseToObject(cfg, "add_bos_token");
        cJSON_AddFalseToObject(cfg, "add_prefix_space");
        cJSON_AddItemToObject(cfg, "additional_special_tokens", extra);
        cJSON_AddNullToObject(cfg, "bos_token");
        cJSON_AddStringToObject(cfg, "chat_template", qt_qwen25_chat_template);
        cJSON_AddFalseToObject(cfg, "clean_up_tokenization_spaces");
        cJSON_AddStringToObject(cfg, "eos_token", "<|im_end|>");
        cJSON_AddStringToObject(cfg, "errors", "replace");
        cJSON_AddNumberToObject(cfg, "model_max_length", c->max_position_embeddings);
        cJSON_AddStringToObject(cfg, "pad_token", "<|endoftext|>");
        cJSON_AddFalseToObject(cfg, "split_special_tokens");
        cJSON_AddStringToObject(cfg, "tokenizer_class", "Qwen2Tokenizer");
        cJSON_AddNullToObject(cfg, "unk_token");
    }
    cJSON_Delete(tok);
    char *text = cfg ? cJSON_Print(cfg) : NULL;
    cJSON_Delete(cfg);
    if (rc == QT_OK && !text) rc = QT_ERR(QT_ENOMEM, "cannot render tokenizer_config.json");
    char path[4096];
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, dir, "tokenizer.json");
    if (rc == QT_OK) rc = qt_copy_file(tokenizer_json, path);
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, dir, "tokenizer_config.json");
    if (rc == QT_OK) rc = qt_write_file_atomic(path, text, strlen(text));
    cJSON_free(text);
    return rc;
}

int qt_model_copy_side_files(const char *src_dir, const char *dst_dir) {
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                                        "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                                        "chat_template.jinja", /* transformers >= 4.43 saves the template here */
                                        /* the original Qwen's tokenizer and the remote code its config.json's
                                         * auto_map names (transformers' trust_remote_code) */
                                        "qwen.tiktoken", "configuration_qwen.py", "modeling_qwen.py",
                                        "tokenization_qwen.py", "qwen_generation_utils.py", "cpp_kernels.py", NULL};
    char s[4096], d[4096];
    for (int i = 0; files[i]; i++) {
        QT_TRY(qt_path_join(s, sizeof s, src_dir, files[i]));
        QT_TRY(qt_path_join(d, sizeof d, dst_dir, files[i]));
        if (qt_path_exists(s)) QT_TRY(qt_copy_file(s, d));
    }
    return QT_OK;
}
