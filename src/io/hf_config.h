/* A Hugging Face config.json for Qwen2ForCausalLM (Qwen1.5, Qwen2, Qwen2.5)
 * and LlamaForCausalLM (no q/k/v bias). Anything the forward pass would get
 * wrong silently (rope_scaling, sliding-window layers, another architecture)
 * is refused with an error that names the field. */
#ifndef QT_IO_HF_CONFIG_H
#define QT_IO_HF_CONFIG_H

#include <stdint.h>

#include "core/dtype.h"

typedef enum { QT_ARCH_QWEN2 = 0, QT_ARCH_LLAMA = 1 } qt_arch;

typedef enum { QT_ROPE_DEFAULT = 0, QT_ROPE_LINEAR, QT_ROPE_DYNAMIC, QT_ROPE_YARN, QT_ROPE_LLAMA3 } qt_rope_type;

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
    int attention_bias;          /* q/k/v carry a bias (Qwen2: yes, Llama: attention_bias) */
    qt_dtype torch_dtype;        /* as the file says; f32 when absent */
    int bos_token_id, eos_token_id; /* -1 when absent */
    float initializer_range;     /* std of `qtune init`'s normal weights; 0 (absent) means 0.02 */
    qt_rope_scaling rope_scaling; /* rope_scaling (type QT_ROPE_DEFAULT when null) */
} qt_config;


int qt_config_load(const char *path, qt_config *cfg);           /* path: config.json or its folder */
int qt_config_parse(const char *json, const char *where, qt_config *cfg); /* where names it in errors */
/* Writes a config.json that transformers loads unchanged (atomic). */
int qt_config_write(const qt_config *cfg, const char *path);

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
