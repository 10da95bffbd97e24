/* A Hugging Face config.json for Qwen2ForCausalLM (Qwen1.5, Qwen2, Qwen2.5),
 * Qwen3ForCausalLM (dense Qwen3: q_norm/k_norm), QWenLMHeadModel (the
 * original Qwen: fused c_attn, its own config keys) and LlamaForCausalLM (no
 * q/k/v bias). All four map onto one decoder (model/qwen2.c); qt_layout gives
 * each its tensor names. Anything the forward pass would get
 * wrong silently (rope_scaling, sliding-window layers, another architecture)
 * is refused with an error that names the field. */
#ifndef QT_IO_HF_CONFIG_H
#define QT_IO_HF_CONFIG_H

#include <stdint.h>

#include "core/dtype.h"

typedef enum { QT_ARCH_QWEN2 = 0, QT_ARCH_LLAMA = 1, QT_ARCH_QWEN3 = 2, QT_ARCH_QWEN = 3 } qt_arch;

typedef enum { QT_ROPE_DEFAULT = 0, QT_ROPE_LINEAR, QT_ROPE_DYNAMIC, QT_ROPE_YARN, QT_ROPE_LLAMA3 } qt_rope_type;
#define QT_ROPE_TYPES 5
/* transformers' rope_type name ("default", "linear", "dynamic", "yarn", "llama3") */
const char *qt_rope_type_name(qt_rope_type t);

/* config.json's rope_scaling (transformers' names; "type" or "rope_type"). */
typedef struct {
    qt_rope_type type;
    float factor;
    int original_max_position_embeddings; /* 0: absent (max_position_embeddings then) */
    float low_freq_factor, high_freq_factor; /* llama3 */
    float beta_fast, beta_slow;              /* yarn; 32 and 1 when absent */
    float attention_factor;                  /* yarn; 0: absent (derived from factor) */
    float mscale, mscale_all_dim;            /* yarn; 0: absent */
    int truncate;                            /* yarn; true when absent */
} qt_rope_scaling;

typedef struct {
    qt_arch arch;
    int vocab_size;              /* V */
    int hidden_size;             /* C */
    int intermediate_size;       /* I */
    int num_hidden_layers;       /* L */
    int num_attention_heads;     /* H */
    int num_key_value_heads;     /* KV */
    int head_dim;                /* D: config's head_dim, else C / H */
    float rms_norm_eps;
    float rope_theta;
    int max_position_embeddings;
    int tie_word_embeddings;
    int attention_bias;          /* q/k/v carry a bias (Qwen2 and the original Qwen: yes, Llama and
                                    Qwen3: attention_bias) */
    int qk_norm;                 /* Qwen3: RMSNorm over head_dim on q and k per head, before RoPE */
    int seq_length;              /* original Qwen: its training length (0 elsewhere) */
    int long_context;            /* original Qwen: use_dynamic_ntk or use_logn_attn, which change the
                                    model past seq_length; max_position_embeddings is then seq_length */
    qt_dtype torch_dtype;        /* as the file says; f32 when absent */
    int bos_token_id, eos_token_id; /* -1 when absent */
    float initializer_range;     /* std of `qtune init`'s normal weights; 0 (absent) means 0.02 */
    qt_rope_scaling rope_scaling; /* rope_scaling (type QT_ROPE_DEFAULT when null) */
    int prequant4;               /* quantization_config of bitsandbytes 4-bit: the layer linears are stored
                                    quantized (transformers' Linear4bit layout; model/qwen2_load.c reads them) */
    int prequant4_type;          /* its bnb_4bit_quant_type (qt_q4_type: 0 nf4, 1 fp4) */
    int prequant4_nested;        /* its bnb_4bit_use_double_quant */
} qt_config;


int qt_config_load(const char *path, qt_config *cfg);           /* path: config.json or its folder */
/* Every id of eos_token_id (an integer or a list, as Llama 3 writes it) in
 * dir/config.json and, where there is one, dir/generation_config.json, which
 * Hugging Face's generate reads first: the ids that end a reply. Each once,
 * at most cap of them. */
int qt_eos_ids_load(const char *dir, int32_t *ids, int cap, int *n);
/* The Hugging Face tensor names of an architecture. The seven linears are
 * those of model_internal.h's LIN_* order (q, k, v, o, gate, up, down); in
 * the original Qwen q, k and v are row slices of one fused attn.c_attn
 * ((H + 2 KV) D, C), so the three share one name, and gate/up are mlp.w2 /
 * mlp.w1 (modeling_qwen.py: c_proj(w1(x) * silu(w2(x)))). */
typedef struct {
    const char *embed;        /* "model.embed_tokens" */
    const char *final_norm;   /* "model.norm" */
    const char *layers;       /* "model.layers": layer l is "<layers>.<l>." */
    const char *ln1, *ln2;    /* "input_layernorm", "post_attention_layernorm" */
    const char *lin[7];       /* "self_attn.q_proj" ... "mlp.down_proj" */
    const char *q_norm, *k_norm; /* "self_attn.q_norm" / "self_attn.k_norm", NULL without qk_norm */
    int fused_qkv;            /* lin[0..2] name one fused tensor */
} qt_layout;
const qt_layout *qt_config_layout(const qt_config *cfg);
const char *qt_arch_name(qt_arch arch); /* "Qwen2ForCausalLM", ... */

int qt_config_parse(const char *json, const char *where, qt_config *cfg); /* where names it in errors */
/* Writes a config.json that transformers loads unchanged (atomic). */
int qt_config_write(const qt_config *cfg, const char *path);

/* The longest sequence the model computes as its modelling code does:
 * max_position_embeddings, or for an original Qwen with dynamic NTK / logn
 * attention on, its seq_length (past it that code changes RoPE and the
 * attention scale, which qtune does not implement). */
int qt_config_max_positions(const qt_config *cfg);

/* rope_scaling's trained length (original_max_position_embeddings, else
 * max_position_embeddings), its factor (YaRN without one: the ratio of the
 * two lengths) and YaRN's cos/sin scale (attention_factor, from mscale and
 * mscale_all_dim, else 0.1 ln(factor) + 1), as transformers computes them. */
int qt_rope_original_length(const qt_config *cfg);
double qt_rope_factor(const qt_config *cfg);
double qt_rope_yarn_attention(const qt_config *cfg);

/* Number of parameters the config implies (embeddings, lm_head when untied,
 * every layer's weights and biases, the final norm). */
int64_t qt_config_param_count(const qt_config *cfg);

/* Presets: real published shapes plus tiny ones for tests and demos; names
 * matched without regard to case. */
int qt_preset(const char *name, qt_config *cfg);
int qt_preset_count(void);
const char *qt_preset_name(int i);
const char *qt_preset_summary(int i); /* one line for `qtune init --help` */

#endif
