/* A Hugging Face model folder (or a PEFT LoRA adapter of one) as the GGUF file
 * llama.cpp loads, with llama.cpp's tensor names and metadata keys for the
 * architecture (see docs/export.md):
 *
 *   model.embed_tokens.weight                -> token_embd.weight
 *   model.layers.N.self_attn.q_proj.weight   -> blk.N.attn_q.weight   (and .bias)
 *   model.layers.N.self_attn.o_proj.weight   -> blk.N.attn_output.weight
 *   model.layers.N.mlp.gate_proj.weight      -> blk.N.ffn_gate.weight  ...
 *   model.norm.weight / lm_head.weight       -> output_norm.weight / output.weight
 *
 * one table per architecture (gguf_export.c). Llama's q/k rows are permuted
 * from Hugging Face's rotate-half RoPE layout to ggml's interleaved one, as
 * llama.cpp's convert_hf_to_gguf.py does; Qwen2 runs ggml's NeoX RoPE, the HF
 * layout, and is written as stored. */
#ifndef QT_EXPORT_GGUF_EXPORT_H
#define QT_EXPORT_GGUF_EXPORT_H

#include <signal.h>
#include <stdio.h>

#include "io/gguf.h"
#include "io/safetensors.h"

/* Where a weight's values come from when it is not read as stored (a merged
 * adapter): sets *fill (NULL: as stored) and *ctx for the HF tensor name. */
typedef void (*gguf_source_fn)(void *src, const char *hf_name, st_fill_fn *fill, void **ctx);

typedef struct {
    gguf_type type;            /* of the 2-D weights; norms and biases stay f32 */
    gguf_source_fn source;     /* NULL: every weight as stored */
    void *source_ctx;
    volatile sig_atomic_t *stop;
    FILE *progress;            /* progress lines (NULL: none) */
    int tty;
    const char *name;          /* general.name; NULL: the folder's name */
    st_file *base;             /* the model's opened safetensors, shared with source (NULL: opened here) */
} gguf_export_opts;

/* Writes out (atomically) from the model folder: config.json, the
 * safetensors weights (shapes checked against the config) and the tokenizer
 * (tokenizer.json, tokenizer_config.json). q8_0 falls back to f16 for a
 * weight whose rows are not a multiple of 32 long (a note says which). */
int gguf_export_model(const char *model_dir, const char *out, const gguf_export_opts *o);

/* Writes out (atomically) as llama.cpp's LoRA adapter GGUF: general.type
 * "adapter", adapter.type "lora", adapter.lora.alpha, and for each adapted
 * weight W (out, in) the tensors "<W's GGUF name>.lora_a" (ne {in, r}) and
 * ".lora_b" (ne {r, out}), in o->type (f32, f16 or bf16). llama.cpp scales by
 * alpha / r, so a use_rslora adapter gets alpha * sqrt(r). The adapter is
 * assumed checked against the model already (qt_merge_set_open). */
int gguf_export_lora(const char *model_dir, const char *adapter_dir, const char *out, const gguf_export_opts *o);

/* The GGUF name of a Hugging Face tensor name for an architecture ("qwen2",
 * "llama"): QT_OK, or QT_EUNSUPPORTED naming the tensor. *permute_heads: the
 * head count whose rows are permuted to ggml's RoPE layout, 0 for none. */
int gguf_tensor_name(int arch, const char *hf_name, int n_head, int n_head_kv, char *out, size_t cap,
                     int *permute_heads);

#endif
