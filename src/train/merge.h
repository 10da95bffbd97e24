/* Merging a PEFT LoRA adapter into its base model, as peft's merge_and_unload
 * does: for each adapted Linear, W' = W + (B @ A) * scaling, computed in fp32
 * and cast once to the output dtype; each modules_to_save weight (embedding,
 * lm_head) replaced by the adapter's trained copy. The result is a model folder that
 * transformers (and llama.cpp's converters) load unchanged. */
#ifndef QT_TRAIN_MERGE_H
#define QT_TRAIN_MERGE_H

#include <signal.h>
#include <stddef.h>

#include "core/dtype.h"
#include "core/progress.h"
#include "io/safetensors.h"

/* model_dir: a model folder (checked first); adapter_dir: a PEFT adapter
 * folder whose tensors must all lie in its target_modules; out_dir: the merged
 * model folder (created; must differ from model_dir). out_dtype < 0 keeps each
 * tensor's stored dtype; otherwise every tensor is cast to it and config.json's
 * torch_dtype / dtype say so. Tokenizer and generation files are copied.
 * Everything is written to a staging folder and moved into out_dir at the
 * end: on an error, or QT_EINTERRUPTED once *stop is set (NULL: never), out_dir
 * is left as it was and nothing else remains. */
int qt_merge_adapter(const char *model_dir, const char *adapter_dir, const char *out_dir, int out_dtype,
                     volatile sig_atomic_t *stop);
/* The same, reporting MB written into prog (core/progress.h; NULL: silent).
 * model_dir may be a bitsandbytes 4-bit folder (io/bnb4.h): the adapter is
 * merged into its dequantized weights (dequantize_4bit's values, + B A *
 * scaling in fp32), written as the dtype they dequantize to (quant_state
 * dtype) or out_dtype, without quantization_config; or, with base16 (NULL:
 * none), into the 16-bit folder it was made from, checked first (every
 * tensor's shape, the 4-bit codes its weights quantize to, the other
 * tensors' bytes). An info line says which, and how far the two differ. */
int qt_merge_adapter_progress(const char *model_dir, const char *base16, const char *adapter_dir, const char *out_dir,
                              int out_dtype, volatile sig_atomic_t *stop, qt_progress *prog);
/* Where the merge into out_dir stages its files (OUT.tmp.PID beside a new
 * OUT, OUT/.qtune-merge.tmp.PID inside an existing one), and top, the highest
 * folder it will create for them (the stage, or the first missing parent of
 * a new OUT). Asked before the merge, it tells a caller that may end the
 * process before the merge returns (the CLI's second Ctrl-C) what to remove:
 * the stage's files, then qt_rmdir_made(stage, top). */
int qt_merge_stage_path(const char *out_dir, char *stage, size_t stage_cap, char *top, size_t top_cap);

/* The merge as a set of producers, for writers other than the merged folder
 * (qtune export --gguf): qt_merge_open_model checks and opens the base folder
 * (the same messages as merge); qt_merge_set_open reads the adapter, pairs
 * each A/B with its weight in base (borrowed: it must outlive the set) and
 * checks names against target_modules and every shape, as merge does. */
typedef struct qt_merge_set qt_merge_set;
int qt_merge_open_model(const char *model_dir, st_file **base);
int qt_merge_set_open(const char *model_dir, const char *adapter_dir, st_file *base, qt_merge_set **out);
/* For the base weight named name: a producer of W' = W + (B @ A) * scaling in
 * f32, row-major, any element range (safetensors' st_fill_fn), or *fill =
 * NULL when the adapter leaves that weight alone. */
void qt_merge_set_lookup(qt_merge_set *s, const char *name, st_fill_fn *fill, void **ctx);
int qt_merge_set_count(const qt_merge_set *s);  /* adapted weights (LoRA and modules_to_save) */
/* 1 when the adapter holds a trained copy (modules_to_save) of a tied base's
 * embedding or lm_head: as PEFT trains each listed module as its own copy,
 * the merged model's embedding and lm_head differ, so merge writes
 * lm_head.weight (the trained copy, or the base embedding when only the
 * embedding was listed; in the embedding's dtype) and sets
 * tie_word_embeddings false in config.json. */
int qt_merge_set_unties(const qt_merge_set *s);
/* A bitsandbytes 4-bit base (io/bnb4.h): how many 4-bit weights the set
 * dequantizes (each one's producer: dequantize_4bit's values, plus B A *
 * scaling where the adapter has a LoRA for it), else 0. adapter_dir may be
 * NULL for such a base: the producers then dequantize only. */
int qt_merge_set_dequantizes(const qt_merge_set *s);
float qt_merge_set_scaling(const qt_merge_set *s);
void qt_merge_set_free(qt_merge_set *s);

#endif
