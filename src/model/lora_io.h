/* LoRA adapters in PEFT's folder format (see io/peft.h) to and from the
 * model's LoRA block. Keys are PEFT's:
 *   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  (r, in)
 *   base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  (out, r)
 * and for the original Qwen (QWenLMHeadModel), whose fused c_attn is ONE
 * module to PEFT:
 *   base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight      (r, C)
 *   base_model.model.transformer.h.{i}.attn.c_attn.lora_B.weight      ((H+2KV)D, r)
 * target_modules are matched by PEFT's rule (an entry matches a module whose
 * name ends with "." + entry), so "c_proj" selects attn.c_proj and mlp.c_proj.
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
int qt_lora_opts_from_adapter(const char *dir, const qt_config *cfg, qt_model_opts *opts);
/* The QT_LORA_* mask PEFT's target_modules select in a model of this config's
 * layout and layers. On an original Qwen model, Qwen2 names (q_proj, ...) are
 * refused with QT_MSG_QWEN1_TARGETS_FMT (core/messages.h): what they are and
 * the list to write. Other refusals as qt_lora_targets_from_peft. */
int qt_lora_targets_for(const qt_config *cfg, const peft_config *pc, unsigned *mask, const char *where);
/* The whole LoRA selection of PEFT config pc in a model of config c:
 * o->lora_targets as qt_lora_targets_for; o->lora_save from modules_to_save
 * (embed_tokens / the original Qwen's wte, and lm_head; anything else is
 * refused by name); o->lora_layers(_set) from layers_to_transform, each
 * module's layer read with layers_pattern as PEFT reads it (a pattern that
 * does not match the architecture's layer list is refused, naming the one to
 * write; so is a layer index the model does not have). */
int qt_lora_resolve(const qt_config *c, const peft_config *pc, qt_model_opts *o, const char *where);
/* The same for a job file's list of names. */
int qt_lora_targets_from_names(const qt_config *cfg, const char *const *names, int n, unsigned *mask,
                               const char *where);
/* PEFT's target_modules names for a mask in cfg's layout (c_attn, c_proj,
 * w1, w2 for the original Qwen); returns how many were written. */
int qt_lora_target_names(const qt_config *cfg, unsigned mask, char names[][64], int cap);
/* The QT_LORA_* mask of the modules PEFT's target_modules (a list, a regex or
 * "all-linear") selects in a Qwen2-layout model of n_layers layers, by PEFT's own
 * matching of each module name (peft_targets_module). Refused by name, with
 * `where` in the message: a module selected in some layers only, lm_head or
 * the embedding selected, a list entry naming no linear module, or nothing
 * selected. */
int qt_lora_targets_from_peft(const peft_config *pc, int n_layers, unsigned *mask, const char *where);
/* Reads DIR/adapter_model.safetensors into the LoRA block: every A/B the model
 * has must be there with its shape, and the file may hold nothing else. */
int qt_lora_load(qt_model *m, const char *dir);
/* modules_to_save, layers_to_transform and layers_pattern of opts as
 * adapter_config.json writes them (the layout's names: embed_tokens or wte,
 * lm_head; layers or h). */
void qt_lora_peft_extras(const qt_config *c, const qt_model_opts *o, peft_config *pc);
/* Writes DIR/adapter_config.json + adapter_model.safetensors (fp32), atomic
 * per file. base_model: base_model_name_or_path ("" when unknown). */
int qt_lora_save(const qt_model *m, const char *dir, const char *base_model);

#endif
