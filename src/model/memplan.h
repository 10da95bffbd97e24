/* The model's memory plan: a pure function of (config, opts) that sizes every
 * buffer the model allocates. qt_model_load allocates exactly these blocks
 * (and two small ones not in the total: the batch ids, max_B * max_T int32
 * four times, and inference's decode logits), carving each with the
 * function that sized it, and `qtune plan` prints the same numbers, so
 * predicted and measured memory agree. */
#ifndef QT_MODEL_MEMPLAN_H
#define QT_MODEL_MEMPLAN_H

#include <stddef.h>
#include <stdint.h>

#include "io/hf_config.h"
#include "model/model.h"

typedef struct {
    size_t master;      /* fp32 trainable block: every weight (full) or the LoRA A/B (lora); sharded
                           (qt_model_opts_sharded) this rank's shard, 0 when that is on the host */
    size_t master_host; /* sharded with opts.master_on_host: the shard in pinned host memory (not in total) */
    size_t grads;       /* its fp32 gradient block (0 for inference) */
    size_t base;        /* frozen base weights as stored in the file (memory-mapped, not allocated) */
    size_t base_f32;    /* norm weights and biases in f32: the frozen base's, or beside a sharded master */
    size_t activations; /* saved for backward: every layer, or each layer's input plus one
                           layer's worth with gradient checkpointing / inference */
    size_t act_grads;   /* backward scratch (activation gradients), 0 for inference */
    size_t workspace;   /* weight panels converted to f32, lm_head vocabulary chunks; full
                           fine-tuning: the kept (N, V) logits (qt_model_keeps_logits) */
    size_t kv_cache;    /* inference only: K and V for max_T positions of every layer */
    size_t compute_copy; /* training in f16/bf16: 2-byte copy of the trainable block (full), or the
                            frozen base converted to the compute dtype when the file's differs (LoRA);
                            ZeRO-3: this rank's shard of it (0 when on the host) */
    size_t quant4;      /* opts.quant4: the 4-bit blocks of the layer linears (0.5 byte a weight plus an
                           absmax a block, core/quant4.h qt_q4_bytes); not in base or compute_copy */
    size_t compute_host; /* ZeRO-3 with opts.param_on_host in f16/bf16: that shard in pinned host memory
                            (not in total) */
    size_t param_gather; /* ZeRO-3: the two layer buffers and the V x C buffer the gathers fill; with
                            QT_OUTER_SLICED the larger of the V x C buffer and one lm_head slice (never
                            held together) */
    size_t outer_gather; /* ZeRO-3: the V x C buffer's bytes (in param_gather) */
    size_t head_slice;   /* ZeRO-3, QT_OUTER_SLICED with a trainable lm_head: one vocabulary slice's bytes,
                            gathered for its backward while the V x C buffer is freed */
    int outer_mode;      /* ZeRO-3: qt_model_outer_mode */
    size_t total;       /* bytes allocated: everything above except base */
} qt_mem_breakdown;

/* A CPU training process beyond the blocks above, measured (docs/plan.md):
 * code, OpenBLAS's buffers, tokenizer and loader, and where the input-
 * gradient products run on oneDNN (op_sgemm_nn) its library and sgemm
 * buffers. Asks the CPU's kernels which sgemm they use (no backend is
 * opened: a plan for a GPU never starts one), so it may load oneDNN. */
size_t qt_model_cpu_runtime_bytes(void);

/* Whether opts shard the fp32 master (model.h master_shards): full fine-tuning in f16/bf16 over 2+
 * ranks. In f32 the master is the weights the graph reads, with LoRA the adapter: whole on every rank. */
int qt_model_opts_sharded(const qt_model_opts *o);

/* ZeRO-3 (opts.param_shards > 1): elements of the largest layer's flat range
 * (every trainable tensor of one decoder layer, contiguous) and of the
 * embedding / lm_head (V x C), the sizes of the gather buffers. */
void qt_model_gather_sizes(const qt_config *c, const qt_model_opts *o, size_t *layer, size_t *outer);

/* ZeRO-3: what stage3_max_reuse_distance (opts.param_reuse_distance, D) makes
 * of the V x C buffer, by DeepSpeed's rule: after a read, a gathered parameter
 * is kept while fewer than D parameters are read before its next use. The
 * graph reads the buffer at the embedding lookup, the lm_head's forward and
 * (trainable, or with preference weights) its backward; *between (may be
 * NULL) gets the parameters read between the lookup and the lm_head's
 * forward, or between the lm_head's backward and the next lookup: every
 * decoder layer's tensors (LoRA: its frozen base and adapter) and the final
 * norm. The lm_head's forward and backward have nothing between them.
 *   QT_OUTER_KEPT     D > *between (DeepSpeed's 1e9 default over Qwen2.5-0.5B's
 *                     3.6e8): the buffer stays allocated; a tied embedding is
 *                     gathered once per optimizer step (not stage 3: always).
 *   QT_OUTER_FREED    0 < D <= *between: freed after the lookup and after the
 *                     lm_head's last read of a micro-batch, gathered again at
 *                     the next read; kept from the lm_head's forward through
 *                     its backward.
 *   QT_OUTER_SLICED   D = 0: freed after every read; a trainable lm_head's
 *                     backward then gathers it one vocabulary slice at a time
 *                     (the gradient windows' slices) into a slice buffer, so
 *                     the whole V x C is never held with the backward's
 *                     reductions in flight. */
enum { QT_OUTER_KEPT, QT_OUTER_FREED, QT_OUTER_SLICED };
int qt_model_outer_mode(const qt_config *c, const qt_model_opts *o, size_t *between);

/* LoRA under ZeRO-3 (qt_model_opts_base_sharded): the frozen base matrices the
 * graph reads in one flat block, partitioned over the ranks as full
 * fine-tuning's weights are and gathered per layer into the same three
 * buffers: the embedding (unless modules_to_save replaced every use of it),
 * the untied lm_head (unless saved), then layer by layer each owned linear
 * (a fused c_attn whole). The norm weights and biases stay whole on every
 * rank (base_f32), as DeepSpeed's stage3_param_persistence_threshold keeps
 * small tensors; the adapter stays whole too (it is trained, and small).
 * Returns the block's elements; *layer (may be NULL) the largest layer's,
 * *outer (may be NULL) V x C, or 0 when no base vocabulary matrix is read. */
int qt_model_opts_base_sharded(const qt_model_opts *o);
size_t qt_model_base_block(const qt_config *c, const qt_model_opts *o, size_t *layer, size_t *outer);
/* The dtype the partitioned base is kept and gathered in: the compute dtype
 * in f16/bf16 (what stage 2 converts the base to), in f32 the file's
 * (config torch_dtype), which the f32 graph reads as stored at stage 2. */
qt_dtype qt_model_base_block_dtype(const qt_config *c, const qt_model_opts *o);

/* Fills *out (may be NULL) and returns out->total. Base dtype is cfg->torch_dtype. */
size_t qt_model_memory(const qt_config *cfg, const qt_model_opts *opts, qt_mem_breakdown *out);

/* The trainable parameter table for (config, opts): HF names for full
 * fine-tuning, PEFT names for LoRA, offsets into the flat block in order.
 * out NULL: count only. Returns the number of entries; *numel (may be NULL)
 * gets the block's size in elements. */
int qt_model_param_table(const qt_config *c, const qt_model_opts *o, qt_param *out, size_t *numel);

/* The backward steps of one decoder layer that complete trainable
 * gradients, in the order layer_backward runs them (qwen2.c): a parameter's
 * qt_param.unit. q_norm/k_norm (Qwen3) complete in the q/k step; a fused
 * c_attn (original Qwen) is unit Q and completes only after the v step. */
enum { QT_GU_DOWN, QT_GU_GATE, QT_GU_UP, QT_GU_LN2, QT_GU_O, QT_GU_Q, QT_GU_K, QT_GU_V, QT_GU_LN1, QT_GU_COUNT };

/* DeepSpeed's default reduce_bucket_size, in elements. */
#define QT_GRAD_BUCKET_DEFAULT ((size_t)500000000)

/* The layers' gradient buckets (opts->grad_windows): the units of layers
 * L-1 down to 0 (those with trainable tensors: under LoRA's
 * layers_to_transform only the adapted ones), each in QT_GU order, packed greedily into buckets of at
 * most `bucket` elements (opts->grad_bucket_elems, 0 = 5e8); a unit larger
 * than that is a bucket of its own (DeepSpeed reduces such a parameter on its
 * own too; ZeRO still cuts its reduction at reduce_bucket_size). A bucket may
 * be one module, several, a whole layer or span layers. Its window holds its
 * tensors packed in flat order, so each run of adjacent tensors is one
 * contiguous range: with bucket = one layer's elements every bucket is
 * exactly one layer, the layout of one window per layer.
 * unit_bucket (may be NULL; L * QT_GU_COUNT entries, [l * QT_GU_COUNT + u])
 * gets each unit's bucket, -1 for a unit without trainable tensors (every
 * unit of a layer LoRA leaves out).
 * Returns the number of buckets; *most (may be NULL) gets the largest
 * bucket's elements. */
int qt_grad_pack(const qt_config *c, const qt_model_opts *o, int *unit_bucket, size_t *most);

/* opts->grad_windows: the windows the backward writes gradients into
 * instead of a gradient block (model.h qt_grad_hook), in floats. */
typedef struct {
    size_t layer;        /* one decoder layer's trainable elements */
    size_t bucket;       /* the largest layer-gradient bucket (qt_grad_pack) */
    int nbuckets;        /* buckets over the layers */
    int nwin;            /* windows: 2 with opts->grad_overlap, else 1 */
    size_t each;         /* each window: max(bucket, slice) */
    size_t layer0;       /* flat offset of layer 0 (the embedding comes first when trainable: full
                            fine-tuning or modules_to_save) */
    size_t norm;         /* the final norm's window (full fine-tuning), else 0 */
    int slice_rows;      /* lm_head vocabulary rows per slice (lm_head trainable: full fine-tuning or
                            modules_to_save), else 0 */
    size_t slice;        /* slice_rows * C: an lm_head slice (in the same windows) */
    size_t targets;      /* int32 slots for a slice's shifted targets (max_B * max_T) */
    size_t total;        /* floats of all windows, 64-byte aligned pieces (qt_model_carve_windows) */
} qt_grad_windows;
void qt_model_grad_windows(const qt_config *c, const qt_model_opts *o, qt_grad_windows *w);
/* The windows' block carved into its pieces, in this order: nwin windows of
 * `each`, the final norm's, the slice targets' (int32 in float slots); an
 * empty piece is NULL. base NULL: size only. Returns the block's floats. */
typedef struct {
    float *win[2];       /* win[0 .. nwin) */
    float *norm;         /* NULL when the final norm is frozen */
    int32_t *targets;    /* NULL when the lm_head is frozen */
} qt_grad_window_ptrs;
size_t qt_model_carve_windows(const qt_grad_windows *w, float *base, qt_grad_window_ptrs *p);

/* Layer l's index among the layers with trainable tensors (every layer but those layers_to_transform leaves
 * out), or -1 when it has none. */
int qt_model_layer_unit(const qt_model_opts *o, int l);

/* The parameter name of a modules_to_save module (QT_SAVE_EMBED or
 * QT_SAVE_LM_HEAD): PEFT's adapter key, base_model.model.model.embed_tokens.weight
 * (the original Qwen: base_model.model.transformer.wte.weight) and
 * base_model.model.lm_head.weight. */
void qt_saved_module_name(const qt_config *c, unsigned which, char *out, size_t cap);

/* Number of trainable parameters (elements of the master block). */
size_t qt_model_trainable_numel(const qt_config *cfg, const qt_model_opts *opts);

#endif
