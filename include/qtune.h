/* qtune's public C API: load a model (optionally with a PEFT LoRA adapter),
 * evaluate it on a dataset, generate from it, train from a job file, merge an
 * adapter.
 *
 * Every function returns 0 on success or a negative code (the QT_E* values of
 * src/core/error.h: -1 invalid input, -2 I/O, -3 out of memory, -4 malformed
 * file, -5 unsupported, -6 interrupted, -7 numeric, -8 distributed); the
 * sentence for the user is qtune_last_error() (per thread). Link with
 * `pkg-config --libs qtune` (libqtune.a and its dependencies). */
#ifndef QTUNE_H
#define QTUNE_H

#include <signal.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

const char *qtune_version(void);
/* The last error's message on this thread ("" when none). */
const char *qtune_last_error(void);

/* An inference model: a Hugging Face model folder (config.json,
 * *.safetensors, tokenizer.json when text is to be read), plus a PEFT LoRA
 * adapter folder or NULL. seq_len and batch size the largest evaluation batch. */
typedef struct qtune_model qtune_model;
int qtune_model_load(const char *model_dir, const char *adapter_dir, int seq_len, int batch, qtune_model **out);
void qtune_model_free(qtune_model *m);

/* Mean next-token cross-entropy (nats) over the labelled tokens of a JSONL
 * dataset (any format qtune trains on; "auto" detects it per file), one
 * example per row, cut to seq_len. *tokens: how many tokens carried a label. */
int qtune_eval(qtune_model *m, const char *data_path, const char *format, double *loss, int64_t *tokens);

/* Continues a prompt of n token ids by up to max_new tokens (out holds
 * max_new), with the decode loop of `qtune generate`: greedy at temperature
 * 0, else sampled from softmax(logits / temperature) with the given seed. It
 * stops at the model's end-of-sequence ids (config.json, generation_config.json,
 * the tokenizer's <|im_end|> and <|endoftext|>, not written to out), after
 * max_new tokens, or when the prompt and reply fill the seq_len the model was
 * loaded with. *n_out: the tokens written. */
int qtune_generate(qtune_model *m, const int32_t *ids, int n, int max_new, float temperature, uint64_t seed,
                   int32_t *out, int *n_out);

/* Trains as the job file says (docs/job-file.md), single process. sets: n_sets
 * "key.path=value" overrides. stop: polled once per step; when it becomes
 * non-zero the step finishes, a checkpoint is written and -6 is returned
 * (NULL: never). final_dir (cap bytes, may be NULL) gets output_dir/final. */
int qtune_train(const char *job_path, const char *const *sets, int n_sets, volatile sig_atomic_t *stop,
                char *final_dir, int cap);

/* Folds a PEFT LoRA adapter into its base model (W += B @ A * scaling) and
 * writes a model folder. dtype: "f32", "bf16", "f16", or NULL to keep it. */
int qtune_merge(const char *model_dir, const char *adapter_dir, const char *out_dir, const char *dtype);

#ifdef __cplusplus
}
#endif

#endif
