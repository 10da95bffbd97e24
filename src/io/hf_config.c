/* Hugging Face config.json: read for Qwen2ForCausalLM and LlamaForCausalLM,
 * written so transformers loads it unchanged.
 *
 * Defaults follow transformers' Qwen2Config and LlamaConfig where a field is
 * optional in practice (num_key_value_heads = heads, rope_theta 10000,
 * rms_norm_eps 1e-6, tie_word_embeddings false for both, attention_bias false
 * for Llama). The shape fields (vocab, hidden, intermediate, layers, heads)
 * are required: a config.json without them is the wrong file, and
 * transformers' silent defaults would build a 7B-sized model. Anything the
 * forward pass would get wrong silently (rope_scaling, sliding-window layers,
 * another activation, Llama's o_proj/MLP biases) is refused with the field
 * named. */
#include "io/hf_config.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CONFIG_MAX_BYTES ((size_t)4 << 20)
/* A dimension beyond this is not a real model (and would overflow int math). */
#define CONFIG_MAX_DIM (1 << 24)

/* Reads an optional positive integer field; *present says whether it was there. */
static int get_int(const cJSON *root, const char *where, const char *key, int required, int lo, int hi,
                   int *out, int *present) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (present) *present = 0;
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return QT_ERR(QT_EFORMAT, "%s: field '%s' is missing; a Qwen2/Llama config.json must give it", where, key);
        return QT_OK;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d == floor(d)) || d < lo || d > hi)
        return QT_ERR(QT_EFORMAT, "%s: field '%s' must be an integer from %d to %d", where, key, lo, hi);
    *out = (int)d;
    if (present) *present = 1;
    return QT_OK;
}

static int get_float(const cJSON *root, const char *where, const char *key, float *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0.0) || !isfinite(v->valuedouble))
        return QT_ERR(QT_EFORMAT, "%s: field '%s' must be a positive number", where, key);
    *out = (float)v->valuedouble;
    return QT_OK;
}

static int get_bool(const cJSON *root, const char *where, const char *key, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (!cJSON_IsBool(v)) return QT_ERR(QT_EFORMAT, "%s: field '%s' must be true or false", where, key);
    *out = cJSON_IsTrue(v);
    return QT_OK;
}

/* A token id value: a whole number in [0, CONFIG_MAX_DIM]; -1 when it is not one. */
static int token_id_value(const cJSON *v) {
    const double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    return d == floor(d) && d >= 0 && d <= CONFIG_MAX_DIM ? (int)d : -1;
}

/* bos/eos ids: an integer, or a list whose first entry is taken (Llama 3;
 * qt_eos_ids_load reads every eos id). */
static int get_token_id(const cJSON *root, const char *where, const char *key, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = -1;
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (cJSON_IsArray(v)) {
        if (cJSON_GetArraySize(v) == 0) return QT_OK;
        v = cJSON_GetArrayItem(v, 0);
    }
    if ((*out = token_id_value(v)) < 0)
        return QT_ERR(QT_EFORMAT, "%s: field '%s' must be a non-negative token id", where, key);
    return QT_OK;
}

/* Architectures qtune knows the name of, with what it says about them. */
static int arch_from_name(const char *s, const char *where, const char *field, qt_arch *arch) {
    static const struct { const char *cls, *type; qt_arch arch; } known[] = {
        {"Qwen2ForCausalLM", "qwen2", QT_ARCH_QWEN2},
        {"Qwen3ForCausalLM", "qwen3", QT_ARCH_QWEN3},
        {"QWenLMHeadModel", "qwen", QT_ARCH_QWEN},
        {"LlamaForCausalLM", "llama", QT_ARCH_LLAMA},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(s, known[i].cls) || !strcmp(s, known[i].type)) {
            *arch = known[i].arch;
            return QT_OK;
        }
    if (!strcmp(s, "Qwen2MoeForCausalLM") || !strcmp(s, "qwen2_moe") || !strcmp(s, "Qwen3MoeForCausalLM") ||
        !strcmp(s, "qwen3_moe"))
        return QT_ERR(QT_EUNSUPPORTED, "%s: %s '%s' is a mixture-of-experts model (Qwen2-MoE / Qwen3-MoE), which qtune does not implement; use a dense Qwen2, Qwen2.5 or Qwen3 model", where, field, s);
    return QT_ERR(QT_EUNSUPPORTED, "%s: %s '%.64s' is not supported; qtune runs Qwen2ForCausalLM (Qwen1.5, Qwen2, Qwen2.5), Qwen3ForCausalLM, QWenLMHeadModel (the original Qwen) and LlamaForCausalLM", where, field, s);
}

static int parse_arch(const cJSON *root, const char *where, qt_arch *arch) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (cJSON_IsArray(a) && cJSON_GetArraySize(a) > 0) {
        const cJSON *a0 = cJSON_GetArrayItem(a, 0);
        if (!cJSON_IsString(a0))
            return QT_ERR(QT_EFORMAT, "%s: field 'architectures' must be a list of class names", where);
        return arch_from_name(a0->valuestring, where, "architecture", arch);
    }
    if (cJSON_IsString(mt)) return arch_from_name(mt->valuestring, where, "model_type", arch);
    return QT_ERR(QT_EFORMAT, "%s: neither 'architectures' nor 'model_type' is given; is this a Hugging Face config.json?", where);
}

/* rope_scaling as transformers reads it: linear, dynamic, yarn, llama3 (and
 * "default"). Another type is refused without suggesting to drop the field:
 * the model was trained with it. */
const char *qt_rope_type_name(qt_rope_type t) {
    static const char *const names[QT_ROPE_TYPES] = {"default", "linear", "dynamic", "yarn", "llama3"};
    return (int)t >= 0 && (int)t < QT_ROPE_TYPES ? names[t] : "?";
}

static int parse_rope_scaling(const cJSON *root, const char *where, qt_rope_scaling *r) {
    memset(r, 0, sizeof *r); /* plain RoPE: all zero */
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (!cJSON_IsObject(v)) return QT_ERR(QT_EFORMAT, "%s: field 'rope_scaling' must be an object or null", where);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "rope_type");
    if (!cJSON_IsString(t)) t = cJSON_GetObjectItemCaseSensitive(v, "type");
    if (!cJSON_IsString(t)) return QT_ERR(QT_EFORMAT, "%s: rope_scaling has no string 'rope_type' (or 'type')", where);
    int found = 0;
    for (int i = 0; i < QT_ROPE_TYPES && !found; i++)
        if (!strcmp(t->valuestring, qt_rope_type_name((qt_rope_type)i))) r->type = (qt_rope_type)i, found = 1;
    if (!found)
        return QT_ERR(QT_EUNSUPPORTED,
                      "%s: rope_scaling type '%.32s' is not supported yet; qtune implements linear, dynamic, yarn and "
                      "llama3 (the model was trained with its scaling, so it cannot be run without it)",
                      where, t->valuestring);
    if (r->type == QT_ROPE_DEFAULT) return QT_OK;
    r->beta_fast = 32.0f, r->beta_slow = 1.0f, r->truncate = 1; /* transformers' yarn defaults */
    int rc = get_float(v, where, "factor", &r->factor);
    if (rc == QT_OK) rc = get_int(v, where, "original_max_position_embeddings", 0, 1, 1 << 30,
                                  &r->original_max_position_embeddings, NULL);
    if (rc == QT_OK) rc = get_float(v, where, "low_freq_factor", &r->low_freq_factor);
    if (rc == QT_OK) rc = get_float(v, where, "high_freq_factor", &r->high_freq_factor);
    if (rc == QT_OK) rc = get_float(v, where, "beta_fast", &r->beta_fast);
    if (rc == QT_OK) rc = get_float(v, where, "beta_slow", &r->beta_slow);
    if (rc == QT_OK) rc = get_float(v, where, "attention_factor", &r->attention_factor);
    if (rc == QT_OK) rc = get_float(v, where, "mscale", &r->mscale);
    if (rc == QT_OK) rc = get_float(v, where, "mscale_all_dim", &r->mscale_all_dim);
    if (rc == QT_OK) rc = get_bool(v, where, "truncate", &r->truncate);
    if (rc != QT_OK) return rc;
    if (!(r->factor > 0) && r->type != QT_ROPE_YARN)
        return QT_ERR(QT_EFORMAT, "%s: rope_scaling type '%s' needs a positive 'factor'", where, t->valuestring);
    if (r->type == QT_ROPE_LLAMA3 &&
        (!(r->low_freq_factor > 0) || !(r->high_freq_factor > r->low_freq_factor) ||
         !r->original_max_position_embeddings))
        return QT_ERR(QT_EFORMAT,
                      "%s: rope_scaling llama3 needs low_freq_factor < high_freq_factor and "
                      "original_max_position_embeddings",
                      where);
    return QT_OK;
}

/* Everything a Qwen2/Llama forward pass here does not do must be absent. */
static int check_unsupported(const cJSON *root, const char *where, const qt_config *c) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (v && !cJSON_IsNull(v) && (!cJSON_IsString(v) || strcmp(v->valuestring, "silu")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: field 'hidden_act' is '%.32s'; qtune implements only \"silu\"", where,
                      cJSON_IsString(v) ? v->valuestring : "(not a string)");
    if (c->arch == QT_ARCH_QWEN2 || c->arch == QT_ARCH_QWEN3) {
        /* Qwen2/Qwen3 use sliding-window attention on layers >= max_window_layers
         * when use_sliding_window is true. */
        int sw = 0;
        QT_TRY(get_bool(root, where, "use_sliding_window", &sw));
        int mwl = 28, mwl_present;
        QT_TRY(get_int(root, where, "max_window_layers", 0, 0, CONFIG_MAX_DIM, &mwl, &mwl_present));
        if (sw && mwl < c->num_hidden_layers)
            return QT_ERR(QT_EUNSUPPORTED, "%s: field 'use_sliding_window' is true and layers %d..%d use sliding-window attention, which qtune does not implement; set use_sliding_window to false",
                          where, mwl, c->num_hidden_layers - 1);
    }
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (cJSON_IsArray(lt)) {
        const cJSON *x;
        cJSON_ArrayForEach(x, lt)
            if (cJSON_IsString(x) && strcmp(x->valuestring, "full_attention"))
                return QT_ERR(QT_EUNSUPPORTED, "%s: field 'layer_types' lists '%.32s'; qtune implements only full_attention layers", where, x->valuestring);
    }
    if (c->arch == QT_ARCH_LLAMA) {
        int mlp_bias = 0;
        QT_TRY(get_bool(root, where, "mlp_bias", &mlp_bias));
        if (mlp_bias)
            return QT_ERR(QT_EUNSUPPORTED, "%s: field 'mlp_bias' is true; qtune's MLP has no biases", where);
        if (c->attention_bias)
            return QT_ERR(QT_EUNSUPPORTED, "%s: field 'attention_bias' is true, which in Llama also puts a bias on o_proj; qtune supports q/k/v biases only (the Qwen2 layout)", where);
    }
    return QT_OK;
}

static int parse_dtype(const cJSON *root, const char *where, qt_dtype *out) {
    *out = QT_F32;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "torch_dtype");
    if (!v || cJSON_IsNull(v)) v = cJSON_GetObjectItemCaseSensitive(root, "dtype"); /* newer transformers */
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (!cJSON_IsString(v)) return QT_ERR(QT_EFORMAT, "%s: field 'torch_dtype' must be a string", where);
    const char *s = v->valuestring;
    if (!strcmp(s, "float32")) *out = QT_F32;
    else if (!strcmp(s, "float16")) *out = QT_F16;
    else if (!strcmp(s, "bfloat16")) *out = QT_BF16;
    else qt_warn("%s: torch_dtype '%.32s' is not float32/float16/bfloat16; treating the stored dtype as unknown (f32)", where, s);
    return QT_OK;
}

/* The original Qwen's config.json (QWenConfig, modeling_qwen.py): its own
 * keys. intermediate_size is twice the MLP width (w1 and w2 are each
 * intermediate_size / 2 wide), kv_channels the head dim, no GQA. Dynamic NTK
 * and logn attention (on in the published configs) only act on sequences
 * longer than seq_length, so such a model is limited to seq_length here. */
static int parse_qwen1(const cJSON *root, const char *where, qt_config *c) {
    int ff2 = 0, no_bias = 1, ntk = 0, logn = 0, scale = 1, bf16 = 0, fp16 = 0, fp32 = 0;
    float pct = 1.0f;
    c->rms_norm_eps = 1e-6f;
    c->rope_theta = 10000.0f;
    c->seq_length = 8192;
    c->max_position_embeddings = 8192;
    c->attention_bias = 1; /* c_attn has a bias whatever no_bias says */
    QT_TRY(get_int(root, where, "vocab_size", 1, 1, CONFIG_MAX_DIM, &c->vocab_size, NULL));
    QT_TRY(get_int(root, where, "hidden_size", 1, 1, CONFIG_MAX_DIM, &c->hidden_size, NULL));
    QT_TRY(get_int(root, where, "intermediate_size", 1, 2, CONFIG_MAX_DIM, &ff2, NULL));
    QT_TRY(get_int(root, where, "num_hidden_layers", 1, 1, 100000, &c->num_hidden_layers, NULL));
    QT_TRY(get_int(root, where, "num_attention_heads", 1, 1, 1 << 16, &c->num_attention_heads, NULL));
    QT_TRY(get_int(root, where, "kv_channels", 1, 1, 1 << 16, &c->head_dim, NULL));
    QT_TRY(get_int(root, where, "seq_length", 0, 1, 1 << 30, &c->seq_length, NULL));
    QT_TRY(get_int(root, where, "max_position_embeddings", 0, 1, 1 << 30, &c->max_position_embeddings, NULL));
    QT_TRY(get_float(root, where, "layer_norm_epsilon", &c->rms_norm_eps));
    QT_TRY(get_float(root, where, "rotary_emb_base", &c->rope_theta));
    QT_TRY(get_float(root, where, "rotary_pct", &pct));
    QT_TRY(get_float(root, where, "initializer_range", &c->initializer_range));
    QT_TRY(get_bool(root, where, "no_bias", &no_bias));
    QT_TRY(get_bool(root, where, "use_dynamic_ntk", &ntk));
    QT_TRY(get_bool(root, where, "use_logn_attn", &logn));
    QT_TRY(get_bool(root, where, "scale_attn_weights", &scale));
    QT_TRY(get_bool(root, where, "tie_word_embeddings", &c->tie_word_embeddings));
    QT_TRY(get_bool(root, where, "bf16", &bf16));
    QT_TRY(get_bool(root, where, "fp16", &fp16));
    QT_TRY(get_bool(root, where, "fp32", &fp32));
    QT_TRY(get_token_id(root, where, "bos_token_id", &c->bos_token_id));
    QT_TRY(get_token_id(root, where, "eos_token_id", &c->eos_token_id));
    QT_TRY(parse_dtype(root, where, &c->torch_dtype));
    if (bf16 + fp16 + fp32 > 1)
        return QT_ERR(QT_EFORMAT, "%s: more than one of the fields 'bf16', 'fp16' and 'fp32' is true; set at most one", where);
    if (bf16) c->torch_dtype = QT_BF16;
    if (fp16) c->torch_dtype = QT_F16;
    if (fp32) c->torch_dtype = QT_F32;
    if (ff2 % 2)
        return QT_ERR(QT_EFORMAT, "%s: field 'intermediate_size' is %d; the original Qwen's is twice the MLP width, so it must be even", where, ff2);
    c->intermediate_size = ff2 / 2;
    c->num_key_value_heads = c->num_attention_heads;
    if ((int64_t)c->head_dim * c->num_attention_heads != c->hidden_size)
        return QT_ERR(QT_EUNSUPPORTED, "%s: kv_channels %d times num_attention_heads %d is not hidden_size %d; the original Qwen's attn.c_proj needs them equal", where,
                      c->head_dim, c->num_attention_heads, c->hidden_size);
    if (pct != 1.0f)
        return QT_ERR(QT_EUNSUPPORTED, "%s: field 'rotary_pct' is %g; qtune rotates the whole head (rotary_pct 1.0) only", where, (double)pct);
    if (!no_bias)
        return QT_ERR(QT_EUNSUPPORTED, "%s: field 'no_bias' is false, which puts biases on attn.c_proj and the MLP; qtune supports the published layout (no_bias true) only", where);
    if (!scale)
        return QT_ERR(QT_EUNSUPPORTED, "%s: field 'scale_attn_weights' is false; qtune's attention always scales by 1/sqrt(kv_channels)", where);
    if (ntk || logn) {
        /* past seq_length modeling_qwen.py rescales RoPE (dynamic NTK) and the queries (logn) at inference:
         * qtune does neither, so it stays within seq_length where both are the identity */
        c->long_context = 1;
    }
    return check_unsupported(root, where, c);
}

/* quantization_config: only bitsandbytes' 4-bit (a pre-quantized folder, e.g.
 * unsloth's "-bnb-4bit"); the tensors are checked as they load. */
static int parse_quant_config(const cJSON *root, const char *where, qt_config *c) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
    if (!q || cJSON_IsNull(q)) return QT_OK;
    if (!cJSON_IsObject(q)) return QT_ERR(QT_EFORMAT, "%s: field 'quantization_config' must be an object", where);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    const char *method = cJSON_IsString(m) ? m->valuestring : "";
    if (strcmp(method, "bitsandbytes"))
        return QT_ERR(QT_EUNSUPPORTED, "%s: quantization_config.quant_method is '%.40s'; qtune reads bitsandbytes 4-bit "
                                       "folders only: use the 16-bit model (with the job's \"quantization\" key)", where,
                      method);
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(q, "load_in_8bit")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: quantization_config is 8-bit (load_in_8bit); qtune reads 4-bit bitsandbytes "
                                       "folders only: use the 16-bit model", where);
    if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(q, "load_in_4bit")))
        return QT_ERR(QT_EFORMAT, "%s: quantization_config names bitsandbytes but not load_in_4bit: true", where);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(q, "bnb_4bit_quant_type");
    const char *type = cJSON_IsString(t) ? t->valuestring : "fp4";
    if (strcmp(type, "nf4") && strcmp(type, "fp4"))
        return QT_ERR(QT_EFORMAT, "%s: quantization_config.bnb_4bit_quant_type is '%.40s', not nf4 or fp4", where, type);
    c->prequant4 = 1;
    c->prequant4_type = !strcmp(type, "fp4");
    c->prequant4_nested = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(q, "bnb_4bit_use_double_quant"));
    return QT_OK;
}

int qt_config_parse(const char *json, const char *where, qt_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(json, &end, 1); /* 1: nothing but whitespace after the object */
    if (!root) return qt_json_parse_error(json, end, where, "fix or re-download it");
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s is not valid JSON (or not a JSON object); fix or re-download it", where);
    }
    int range_rc = qt_json_check_range(json, end ? (size_t)(end - json) : strlen(json), where);
    if (range_rc != QT_OK) {
        cJSON_Delete(root);
        return range_rc;
    }
    qt_config c;
    memset(&c, 0, sizeof c);
    int rc = parse_arch(root, where, &c.arch);
    if (rc == QT_OK && c.arch == QT_ARCH_QWEN) {
        rc = parse_qwen1(root, where, &c);
    } else if (rc == QT_OK) {
        int kv_present = 0, hd_present = 0;
        c.rms_norm_eps = 1e-6f;
        c.rope_theta = 10000.0f;
        c.max_position_embeddings = c.arch == QT_ARCH_LLAMA ? 2048 : c.arch == QT_ARCH_QWEN3 ? 32768 : 32768;
        c.tie_word_embeddings = 0;
        c.attention_bias = c.arch == QT_ARCH_QWEN2;
        c.qk_norm = c.arch == QT_ARCH_QWEN3;
        if (rc == QT_OK) rc = get_int(root, where, "vocab_size", 1, 1, CONFIG_MAX_DIM, &c.vocab_size, NULL);
        if (rc == QT_OK) rc = get_int(root, where, "hidden_size", 1, 1, CONFIG_MAX_DIM, &c.hidden_size, NULL);
        if (rc == QT_OK) rc = get_int(root, where, "intermediate_size", 1, 1, CONFIG_MAX_DIM, &c.intermediate_size, NULL);
        if (rc == QT_OK) rc = get_int(root, where, "num_hidden_layers", 1, 1, 100000, &c.num_hidden_layers, NULL);
        if (rc == QT_OK) rc = get_int(root, where, "num_attention_heads", 1, 1, 1 << 16, &c.num_attention_heads, NULL);
        if (rc == QT_OK) rc = get_int(root, where, "num_key_value_heads", 0, 1, 1 << 16, &c.num_key_value_heads, &kv_present);
        if (rc == QT_OK) rc = get_int(root, where, "head_dim", 0, 1, 1 << 16, &c.head_dim, &hd_present);
        if (rc == QT_OK) rc = get_int(root, where, "max_position_embeddings", 0, 1, 1 << 30, &c.max_position_embeddings, NULL);
        if (rc == QT_OK) rc = get_float(root, where, "rms_norm_eps", &c.rms_norm_eps);
        if (rc == QT_OK) rc = get_float(root, where, "rope_theta", &c.rope_theta);
        if (rc == QT_OK) rc = get_float(root, where, "initializer_range", &c.initializer_range);
        if (rc == QT_OK) rc = get_bool(root, where, "tie_word_embeddings", &c.tie_word_embeddings);
        /* Qwen2's q/k/v always carry a bias (Qwen2Attention ignores attention_bias) */
        if (rc == QT_OK && c.arch != QT_ARCH_QWEN2) rc = get_bool(root, where, "attention_bias", &c.attention_bias);
        if (rc == QT_OK) rc = get_token_id(root, where, "bos_token_id", &c.bos_token_id);
        if (rc == QT_OK) rc = get_token_id(root, where, "eos_token_id", &c.eos_token_id);
        if (rc == QT_OK) rc = parse_dtype(root, where, &c.torch_dtype);
        if (rc == QT_OK) rc = check_unsupported(root, where, &c);
        if (rc == QT_OK) rc = parse_rope_scaling(root, where, &c.rope_scaling);
        if (rc == QT_OK) {
            if (!kv_present) c.num_key_value_heads = c.num_attention_heads;
            if (!hd_present && c.arch == QT_ARCH_QWEN3) {
                c.head_dim = 128; /* transformers' Qwen3Config default, not hidden / heads */
            } else if (!hd_present) {
                if (c.hidden_size % c.num_attention_heads)
                    rc = QT_ERR(QT_EFORMAT, "%s: hidden_size %d is not divisible by num_attention_heads %d (and no head_dim is given)", where,
                                c.hidden_size, c.num_attention_heads);
                c.head_dim = c.hidden_size / c.num_attention_heads;
            }
        }
    }
    if (rc == QT_OK && c.num_attention_heads % c.num_key_value_heads)
        rc = QT_ERR(QT_EFORMAT, "%s: num_attention_heads %d is not divisible by num_key_value_heads %d", where,
                    c.num_attention_heads, c.num_key_value_heads);
    if (rc == QT_OK && c.head_dim % 2)
        rc = QT_ERR(QT_EFORMAT, "%s: head_dim %d is odd; rotary embeddings need an even head dimension", where, c.head_dim);
    if (rc == QT_OK) rc = parse_quant_config(root, where, &c);
    cJSON_Delete(root);
    if (rc == QT_OK) *cfg = c;
    return rc;
}

int qt_config_load(const char *path, qt_config *cfg) {
    char buf[4096];
    const char *file = path;
    if (qt_is_dir(path)) {
        QT_TRY(qt_path_join(buf, sizeof buf, path, "config.json"));
        file = buf;
    }
    char *text;
    QT_TRY(qt_read_file(file, CONFIG_MAX_BYTES, &text, NULL));
    int rc = qt_config_parse(text, file, cfg);
    qt_free(text);
    return rc;
}

/* The ids of one file's eos_token_id (an integer or a list) added to ids[0, *n) once each. */
static int add_eos_ids(const char *file, int32_t *ids, int cap, int *n) {
    char *text;
    QT_TRY(qt_read_file(file, CONFIG_MAX_BYTES, &text, NULL));
    cJSON *root = cJSON_ParseWithOpts(text, NULL, 1);
    qt_free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object; fix it or remove it", file);
    }
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    int rc = QT_OK;
    const cJSON *it = cJSON_IsArray(v) ? v->child : v && !cJSON_IsNull(v) ? v : NULL;
    for (; rc == QT_OK && it; it = cJSON_IsArray(v) ? it->next : NULL) {
        const int id = token_id_value(it);
        if (id < 0) rc = QT_ERR(QT_EFORMAT, "%s: eos_token_id must be a token id or a list of them", file);
        int seen = 0;
        for (int i = 0; rc == QT_OK && i < *n; i++) seen |= ids[i] == id;
        if (rc == QT_OK && !seen && *n < cap) ids[(*n)++] = id;
    }
    cJSON_Delete(root);
    return rc;
}

int qt_eos_ids_load(const char *dir, int32_t *ids, int cap, int *n) {
    static const char *const files[] = {"config.json", "generation_config.json"};
    *n = 0;
    for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
        char file[4096];
        QT_TRY(qt_path_join(file, sizeof file, dir, files[k]));
        if (k && !qt_path_exists(file)) continue;
        QT_TRY(add_eos_ids(file, ids, cap, n));
    }
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * Writing */

/* Shortest decimal that reads back as the same float, always with a '.' or an
 * exponent so Python reads a float (1e-06, 1000000.0). */
static void float_str(char *out, size_t cap, float v) {
    if (v == (float)(int64_t)v && fabsf(v) < 1e15f) { /* 1000000.0, as Python writes it */
        snprintf(out, cap, "%.1f", (double)v);
        return;
    }
    for (int p = 1; p <= 9; p++) {
        snprintf(out, cap, "%.*g", p, (double)v);
        if ((float)strtod(out, NULL) == v) break;
    }
    if (!strpbrk(out, ".eEn")) {
        size_t n = strlen(out);
        if (n + 3 <= cap) memcpy(out + n, ".0", 3);
    }
}

static const char *dtype_torch_name(qt_dtype t) {
    switch (t) {
    case QT_F16: return "float16";
    case QT_BF16: return "bfloat16";
    default: return "float32";
    }
}

/* The version whose config classes these fields follow (Qwen2.5's release). */
#define CONFIG_TRANSFORMERS_VERSION "4.43.1"

/* rope_scaling as JSON ("null" when plain). */
static void rope_json(const qt_rope_scaling *r, char *buf, size_t cap) {
    if (r->type == QT_ROPE_DEFAULT) {
        snprintf(buf, cap, "null");
        return;
    }
    char f[32];
    float_str(f, sizeof f, r->factor);
    int n = snprintf(buf, cap, "{\"factor\": %s, \"rope_type\": \"%s\"", f, qt_rope_type_name(r->type));
    if (r->original_max_position_embeddings && n > 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, ", \"original_max_position_embeddings\": %d",
                      r->original_max_position_embeddings);
    if (r->type == QT_ROPE_LLAMA3 && n > 0 && (size_t)n < cap) {
        char lo[32], hi[32];
        float_str(lo, sizeof lo, r->low_freq_factor);
        float_str(hi, sizeof hi, r->high_freq_factor);
        n += snprintf(buf + n, cap - (size_t)n, ", \"low_freq_factor\": %s, \"high_freq_factor\": %s", lo, hi);
    }
    if (r->type == QT_ROPE_YARN && n > 0 && (size_t)n < cap) {
        char bf[32], bs[32], af[32];
        float_str(bf, sizeof bf, r->beta_fast);
        float_str(bs, sizeof bs, r->beta_slow);
        n += snprintf(buf + n, cap - (size_t)n, ", \"beta_fast\": %s, \"beta_slow\": %s, \"truncate\": %s", bf,
                      bs, r->truncate ? "true" : "false");
        if (r->attention_factor > 0 && n > 0 && (size_t)n < cap) {
            float_str(af, sizeof af, r->attention_factor);
            n += snprintf(buf + n, cap - (size_t)n, ", \"attention_factor\": %s", af);
        }
    }
    if (n > 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, "}");
}

/* Qwen3ForCausalLM as transformers 4.51 (the first with Qwen3) writes it. */
static int write_qwen3(const qt_config *c, const char *path, const char *bos, const char *eos, const char *eps,
                       const char *theta, const char *init, const char *rope) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\n    \"Qwen3ForCausalLM\"\n  ],\n"
                     "  \"attention_bias\": %s,\n"
                     "  \"attention_dropout\": 0.0,\n"
                     "  \"bos_token_id\": %s,\n"
                     "  \"eos_token_id\": %s,\n"
                     "  \"head_dim\": %d,\n"
                     "  \"hidden_act\": \"silu\",\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"initializer_range\": %s,\n"
                     "  \"intermediate_size\": %d,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"max_window_layers\": %d,\n"
                     "  \"model_type\": \"qwen3\",\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"num_key_value_heads\": %d,\n"
                     "  \"rms_norm_eps\": %s,\n"
                     "  \"rope_scaling\": %s,\n"
                     "  \"rope_theta\": %s,\n"
                     "  \"sliding_window\": null,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"transformers_version\": \"4.51.0\",\n"
                     "  \"use_cache\": true,\n"
                     "  \"use_sliding_window\": false,\n"
                     "  \"vocab_size\": %d\n"
                     "}\n",
                     c->attention_bias ? "true" : "false", bos, eos, c->head_dim, c->hidden_size, init,
                     c->intermediate_size, c->max_position_embeddings, c->num_hidden_layers, c->num_attention_heads,
                     c->num_hidden_layers, c->num_key_value_heads, eps, rope, theta,
                     c->tie_word_embeddings ? "true" : "false", dtype_torch_name(c->torch_dtype), c->vocab_size);
    if (n < 0 || (size_t)n >= sizeof buf) return QT_ERR(QT_EINVAL, "config for %s does not fit the write buffer", path);
    return qt_write_file_atomic(path, buf, (size_t)n);
}

/* QWenConfig's keys, as Qwen-14B's config.json has them (the modelling code
 * itself comes with the folder: auto_map names it, trust_remote_code loads
 * it). The dtype flags say which dtype transformers loads in. */
static int write_qwen1(const qt_config *c, const char *path, const char *eps, const char *theta, const char *init) {
    char buf[4096], ids[80] = "";
    int ntk = c->long_context;
    /* the published configs carry no token ids (generation_config.json does); write those set */
    int k = 0;
    if (c->bos_token_id >= 0) k += snprintf(ids + k, sizeof ids - (size_t)k, "  \"bos_token_id\": %d,\n", c->bos_token_id);
    if (c->eos_token_id >= 0) snprintf(ids + k, sizeof ids - (size_t)k, "  \"eos_token_id\": %d,\n", c->eos_token_id);
    int n = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\n    \"QWenLMHeadModel\"\n  ],\n"
                     "  \"attn_dropout_prob\": 0.0,\n"
                     "  \"auto_map\": {\n"
                     "    \"AutoConfig\": \"configuration_qwen.QWenConfig\",\n"
                     "    \"AutoModelForCausalLM\": \"modeling_qwen.QWenLMHeadModel\"\n"
                     "  },\n"
                     "  \"bf16\": %s,\n"
                     "%s"
                     "  \"emb_dropout_prob\": 0.0,\n"
                     "  \"fp16\": %s,\n"
                     "  \"fp32\": %s,\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"initializer_range\": %s,\n"
                     "  \"intermediate_size\": %d,\n"
                     "  \"kv_channels\": %d,\n"
                     "  \"layer_norm_epsilon\": %s,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"model_type\": \"qwen\",\n"
                     "  \"no_bias\": true,\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"onnx_safe\": null,\n"
                     "  \"rotary_emb_base\": %s,\n"
                     "  \"rotary_pct\": 1.0,\n"
                     "  \"scale_attn_weights\": true,\n"
                     "  \"seq_length\": %d,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"tokenizer_class\": \"QWenTokenizer\",\n"
                     "  \"transformers_version\": \"4.32.0\",\n"
                     "  \"use_cache\": true,\n"
                     "  \"use_dynamic_ntk\": %s,\n"
                     "  \"use_flash_attn\": \"auto\",\n"
                     "  \"use_logn_attn\": %s,\n"
                     "  \"vocab_size\": %d\n"
                     "}\n",
                     c->torch_dtype == QT_BF16 ? "true" : "false", ids, c->torch_dtype == QT_F16 ? "true" : "false",
                     c->torch_dtype == QT_F32 ? "true" : "false", c->hidden_size, init, 2 * c->intermediate_size,
                     c->head_dim, eps, c->max_position_embeddings, c->num_attention_heads, c->num_hidden_layers, theta,
                     c->seq_length > 0 ? c->seq_length : c->max_position_embeddings,
                     c->tie_word_embeddings ? "true" : "false", ntk ? "true" : "false", ntk ? "true" : "false",
                     c->vocab_size);
    if (n < 0 || (size_t)n >= sizeof buf) return QT_ERR(QT_EINVAL, "config for %s does not fit the write buffer", path);
    return qt_write_file_atomic(path, buf, (size_t)n);
}

int qt_config_write(const qt_config *c, const char *path) {
    char eps[32], theta[32], bos[16], eos[16], init[32], rope[512];
    rope_json(&c->rope_scaling, rope, sizeof rope);
    float_str(eps, sizeof eps, c->rms_norm_eps);
    float_str(init, sizeof init, c->initializer_range > 0.0f ? c->initializer_range : 0.02f);
    float_str(theta, sizeof theta, c->rope_theta);
    if (c->bos_token_id >= 0) snprintf(bos, sizeof bos, "%d", c->bos_token_id);
    else snprintf(bos, sizeof bos, "null");
    if (c->eos_token_id >= 0) snprintf(eos, sizeof eos, "%d", c->eos_token_id);
    else snprintf(eos, sizeof eos, "null");
    if (c->arch == QT_ARCH_QWEN3) return write_qwen3(c, path, bos, eos, eps, theta, init, rope);
    if (c->arch == QT_ARCH_QWEN) return write_qwen1(c, path, eps, theta, init);
    int qwen = c->arch == QT_ARCH_QWEN2;
    /* Qwen2Config has no head_dim before transformers 4.48 (it is hidden/heads):
     * write it only when it differs, which older versions cannot load anyway. */
    char hd_line[48] = "";
    if (c->num_attention_heads > 0 && c->head_dim * c->num_attention_heads != c->hidden_size)
        snprintf(hd_line, sizeof hd_line, "  \"head_dim\": %d,\n", c->head_dim);
    char buf[4096];
    int n;
    /* Keys sorted, two-space indent: the way transformers' save_pretrained writes it. */
    if (qwen) {
        n = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\n    \"Qwen2ForCausalLM\"\n  ],\n"
                     "  \"attention_dropout\": 0.0,\n"
                     "  \"bos_token_id\": %s,\n"
                     "  \"eos_token_id\": %s,\n"
                     "%s"
                     "  \"hidden_act\": \"silu\",\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"initializer_range\": %s,\n"
                     "  \"intermediate_size\": %d,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"max_window_layers\": %d,\n"
                     "  \"model_type\": \"qwen2\",\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"num_key_value_heads\": %d,\n"
                     "  \"rms_norm_eps\": %s,\n"
                     "  \"rope_scaling\": %s,\n"
                     "  \"rope_theta\": %s,\n"
                     "  \"sliding_window\": %d,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"transformers_version\": \"" CONFIG_TRANSFORMERS_VERSION "\",\n"
                     "  \"use_cache\": true,\n"
                     "  \"use_sliding_window\": false,\n"
                     "  \"vocab_size\": %d\n"
                     "}\n",
                     bos, eos, hd_line, c->hidden_size, init, c->intermediate_size, c->max_position_embeddings,
                     c->num_hidden_layers, c->num_attention_heads, c->num_hidden_layers, c->num_key_value_heads, eps,
                     rope, theta, c->max_position_embeddings, c->tie_word_embeddings ? "true" : "false",
                     dtype_torch_name(c->torch_dtype), c->vocab_size);
    } else {
        n = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\n    \"LlamaForCausalLM\"\n  ],\n"
                     "  \"attention_bias\": %s,\n"
                     "  \"attention_dropout\": 0.0,\n"
                     "  \"bos_token_id\": %s,\n"
                     "  \"eos_token_id\": %s,\n"
                     "  \"head_dim\": %d,\n"
                     "  \"hidden_act\": \"silu\",\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"initializer_range\": %s,\n"
                     "  \"intermediate_size\": %d,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"mlp_bias\": false,\n"
                     "  \"model_type\": \"llama\",\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"num_key_value_heads\": %d,\n"
                     "  \"pretraining_tp\": 1,\n"
                     "  \"rms_norm_eps\": %s,\n"
                     "  \"rope_scaling\": %s,\n"
                     "  \"rope_theta\": %s,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"transformers_version\": \"" CONFIG_TRANSFORMERS_VERSION "\",\n"
                     "  \"use_cache\": true,\n"
                     "  \"vocab_size\": %d\n"
                     "}\n",
                     c->attention_bias ? "true" : "false", bos, eos, c->head_dim, c->hidden_size, init,
                     c->intermediate_size, c->max_position_embeddings, c->num_attention_heads, c->num_hidden_layers,
                     c->num_key_value_heads, eps, rope, theta, c->tie_word_embeddings ? "true" : "false",
                     dtype_torch_name(c->torch_dtype), c->vocab_size);
    }
    if (n < 0 || (size_t)n >= sizeof buf) return QT_ERR(QT_EINVAL, "config for %s does not fit the write buffer", path);
    return qt_write_file_atomic(path, buf, (size_t)n);
}

int qt_config_max_positions(const qt_config *c) {
    if (c->long_context && c->seq_length > 0 && c->seq_length < c->max_position_embeddings) return c->seq_length;
    return c->max_position_embeddings;
}

int qt_rope_original_length(const qt_config *c) {
    const qt_rope_scaling *r = &c->rope_scaling;
    return r->original_max_position_embeddings ? r->original_max_position_embeddings : c->max_position_embeddings;
}

double qt_rope_factor(const qt_config *c) {
    const qt_rope_scaling *r = &c->rope_scaling;
    if (r->factor > 0 || r->type != QT_ROPE_YARN) return r->factor;
    return (double)c->max_position_embeddings / qt_rope_original_length(c);
}

double qt_rope_yarn_attention(const qt_config *c) {
    const qt_rope_scaling *r = &c->rope_scaling;
    const double factor = qt_rope_factor(c);
    if (r->attention_factor > 0) return r->attention_factor;
    if (r->mscale > 0 && r->mscale_all_dim > 0)
        return (factor <= 1 ? 1.0 : 0.1 * r->mscale * log(factor) + 1.0) /
               (factor <= 1 ? 1.0 : 0.1 * r->mscale_all_dim * log(factor) + 1.0);
    return factor <= 1 ? 1.0 : 0.1 * log(factor) + 1.0;
}

int64_t qt_config_param_count(const qt_config *c) {
    int64_t C = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
    int64_t q = (int64_t)c->num_attention_heads * c->head_dim, kv = (int64_t)c->num_key_value_heads * c->head_dim;
    int64_t layer = C * q + 2 * C * kv + q * C /* q, k, v, o */ + 3 * C * I /* gate, up, down */ + 2 * C /* norms */;
    if (c->attention_bias) layer += q + 2 * kv;
    if (c->qk_norm) layer += 2 * (int64_t)c->head_dim;
    return V * C * (c->tie_word_embeddings ? 1 : 2) + c->num_hidden_layers * layer + C;
}

static const qt_layout layout_qwen2 = {
    "model.embed_tokens", "model.norm", "model.layers", "input_layernorm", "post_attention_layernorm",
    {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
     "mlp.down_proj"},
    NULL, NULL, 0};
static const qt_layout layout_qwen3 = {
    "model.embed_tokens", "model.norm", "model.layers", "input_layernorm", "post_attention_layernorm",
    {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
     "mlp.down_proj"},
    "self_attn.q_norm", "self_attn.k_norm", 0};
static const qt_layout layout_qwen1 = {
    "transformer.wte", "transformer.ln_f", "transformer.h", "ln_1", "ln_2",
    {"attn.c_attn", "attn.c_attn", "attn.c_attn", "attn.c_proj", "mlp.w2", "mlp.w1", "mlp.c_proj"},
    NULL, NULL, 1};

const qt_layout *qt_config_layout(const qt_config *c) {
    if (c->arch == QT_ARCH_QWEN) return &layout_qwen1;
    if (c->qk_norm) return &layout_qwen3;
    return &layout_qwen2;
}

const char *qt_arch_name(qt_arch a) {
    switch (a) {
    case QT_ARCH_LLAMA: return "LlamaForCausalLM";
    case QT_ARCH_QWEN3: return "Qwen3ForCausalLM";
    case QT_ARCH_QWEN: return "QWenLMHeadModel";
    default: return "Qwen2ForCausalLM";
    }
}
