/* Writing a Hugging Face model folder: randomly initialised weights (as
 * transformers' _init_weights does), generation_config.json, and the
 * tokenizer files with Qwen2.5's ChatML chat template. Used by `qtune init`;
 * the weight-name helpers and the tokenizer/generation writers also serve
 * anything else that writes a model folder (merge, full fine-tuning). */
#ifndef QT_IO_MODEL_FOLDER_H
#define QT_IO_MODEL_FOLDER_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/progress.h"
#include "io/hf_config.h"

/* The HF tensor names and shapes a config implies, in a stable order:
 * model.embed_tokens.weight, per layer input_layernorm, self_attn.{q,k,v,o}_proj
 * (+ q/k/v bias when cfg->attention_bias, + q_norm/k_norm in Qwen3),
 * post_attention_layernorm, mlp.{gate,up,down}_proj, then model.norm.weight
 * and lm_head.weight (untied only); the original Qwen's names and fused
 * c_attn come from qt_config_layout. */
typedef enum { QT_INIT_NORMAL = 0, QT_INIT_ZEROS = 1, QT_INIT_ONES = 2 } qt_init_kind;
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    qt_init_kind init; /* how transformers initialises it */
} qt_weight_spec;
int qt_weight_count(const qt_config *cfg);
/* i in [0, qt_weight_count); QT_EINVAL when out of range. */
int qt_weight_spec_at(const qt_config *cfg, int i, qt_weight_spec *out);

/* Writes path (a .safetensors file, atomically) with every weight of cfg in
 * dtype: normal(0, 0.02) for linear and embedding weights, zeros for biases,
 * ones for norms. Each tensor draws from its own stream, derived from seed and
 * a hash of its name, so the values do not depend on the write order. The
 * tensors are produced chunk by chunk while writing: memory stays small
 * whatever the model size. */
int qt_init_weights_write(const qt_config *cfg, qt_dtype dtype, uint64_t seed, const char *path);
/* The same, counting parameters written into prog (core/progress.h; NULL: silent). */
int qt_init_weights_write_progress(const qt_config *cfg, qt_dtype dtype, uint64_t seed, const char *path,
                                   qt_progress *prog);

/* generation_config.json (bos/eos/pad ids from cfg, greedy by default). */
int qt_generation_config_write(const qt_config *cfg, const char *dir);

/* Ids of the special tokens a Qwen tokenizer.json declares; -1 when absent. */
typedef struct {
    int endoftext; /* <|endoftext|> */
    int im_start;  /* <|im_start|> */
    int im_end;    /* <|im_end|> */
    int max_id;    /* largest id in model.vocab and added_tokens */
} qt_tokenizer_ids;
/* Reads a tokenizer.json just far enough for the ids above (not a tokenizer). */
int qt_tokenizer_ids_read(const char *tokenizer_json, qt_tokenizer_ids *ids);

/* Copies tokenizer_json to dir/tokenizer.json and writes dir/tokenizer_config.json
 * (Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>, Qwen2.5's ChatML chat
 * template). Refuses a tokenizer whose ids do not fit cfg->vocab_size. */
int qt_tokenizer_files_write(const qt_config *cfg, const char *tokenizer_json, const char *dir);

/* Copies the tokenizer and generation files a model folder may carry
 * (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt,
 * special_tokens_map.json, added_tokens.json, generation_config.json; the
 * original Qwen's qwen.tiktoken and its *_qwen.py remote code) from
 * src_dir to dst_dir; those src_dir lacks are skipped. Not config.json: the
 * callers copy or rewrite it themselves. */
int qt_model_copy_side_files(const char *src_dir, const char *dst_dir);

/* Qwen2.5-Instruct's chat template (Jinja), as its tokenizer_config.json has it. */
extern const char qt_qwen25_chat_template[];
/* The original Qwen-Chat's ChatML as a template (Qwen2-Instruct's). */
extern const char qt_qwen_chatml_template[];

#endif
