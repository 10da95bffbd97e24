/* LoRA adapters in PEFT's folder format (see io/peft.h) to and from the
 * model's LoRA block. Keys are PEFT's:
 *   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  (r, in)
 *   base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  (out, r)
 * Typical use (eval --adapter, train's init_from):
 *   qt_lora_opts_from_adapter(dir, cfg.num_hidden_layers, &opts);   // r, alpha, dropout, targets, rslora
 *   qt_model_load(model_dir, &opts, &m);
 *   qt_lora_load(m, dir); */
#ifndef QT_MODEL_LORA_IO_H
#define QT_MODEL_LORA_IO_H

#include "io/peft.h"
#include "model/model.h"

/* Sets opts->lora = 1 and the LoRA fields from DIR/adapter_config.json, for
 * a model of n_layers layers (its target_modules are matched against the
 * module names of every layer). */
int qt_lora_opts_from_adapter(const char *dir, int n_layers, qt_model_opts *opts);
/* The QT_LORA_* mask of the modules PEFT's target_modules (a list, a regex or
 * "all-linear") selects in a Qwen2 model of n_layers layers, by PEFT's own
 * matching of each module name (peft_targets_module). Refused by name, with
 * `where` in the message: a module selected in some layers only, lm_head or
 * the embedding selected, a list entry naming no linear module, or nothing
 * selected. */
int qt_lora_targets_from_peft(const peft_config *pc, int n_layers, unsigned *mask, const char *where);
/* Maps PEFT target_modules names (q_proj ... down_proj) to a QT_LORA_* mask. */
int qt_lora_targets_parse(const char *const *names, int n, unsigned *mask);
/* Reads DIR/adapter_model.safetensors into the LoRA block: every A/B the model
 * has must be there with its shape, and the file may hold nothing else. */
int qt_lora_load(qt_model *m, const char *dir);
/* Writes DIR/adapter_config.json + adapter_model.safetensors (fp32), atomic
 * per file. base_model: base_model_name_or_path ("" when unknown). */
int qt_lora_save(const qt_model *m, const char *dir, const char *base_model);

#endif
