/* The Qwen2-family model as the trainer sees it.
 *
 * Trainable parameters live in ONE flat fp32 block (the master weights), with
 * a same-sized fp32 gradient block; a table of qt_param names each tensor's
 * place in it, with its Hugging Face (or PEFT) name. For full fine-tuning that
 * is every weight; for LoRA it is only the A/B matrices, and the frozen base
 * stays in its own block (memory-mapped or in the compute dtype) with no
 * gradient buffer. The optimizer, clipping, ZeRO sharding and checkpoints all
 * work on the flat block by element ranges, so none of them knows the graph.
 *
 * Dimension letters: B batch, T sequence, C hidden, H heads, KV kv heads,
 * D head dim, I intermediate, V vocab, L layers, R lora rank. */
#ifndef QT_MODEL_MODEL_H
#define QT_MODEL_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/dtype.h"
#include "data/batch.h"
#include "core/shard.h"
#include "io/hf_config.h"

typedef struct {
    char name[160];     /* e.g. model.layers.0.self_attn.q_proj.weight, or
                           base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight */
    int ndim;
    int64_t shape[2];
    size_t offset;      /* element offset into the flat trainable block */
    size_t numel;
    int decay;          /* weight decay applies: 2-D weight matrices only (HF Trainer grouping) */
    int layer;          /* decoder layer, -1 outside the layers (embedding, final norm, lm_head) */
    int unit;           /* in a layer: the backward step that completes its gradient (memplan.h QT_GU_*) */
} qt_param;

/* LoRA target modules, PEFT names. */
enum {
    QT_LORA_Q = 1 << 0, QT_LORA_K = 1 << 1, QT_LORA_V = 1 << 2, QT_LORA_O = 1 << 3,
    QT_LORA_GATE = 1 << 4, QT_LORA_UP = 1 << 5, QT_LORA_DOWN = 1 << 6,
};

/* PEFT's modules_to_save that qtune trains beside an adapter: the embedding
 * and the lm_head, trained fully (every weight gets a gradient and AdamW
 * state) while the rest of the base stays frozen. On a model with tied
 * embeddings each listed one becomes its own trained copy, as PEFT's
 * ModulesToSaveWrapper makes it (the other keeps the frozen base weight). */
enum { QT_SAVE_EMBED = 1 << 0, QT_SAVE_LM_HEAD = 1 << 1 };

/* layers_to_transform as a bitmap of layer indices (QT_LORA_MAX_LAYERS at most). */
#define QT_LORA_MAX_LAYERS 1024
#define QT_LORA_LAYER_WORDS (QT_LORA_MAX_LAYERS / 64)

/* What a job's "lora" and "quantization" sections ask of the model: the
 * adapter, which linears and layers it adapts, what is trained beside it,
 * and the base's 4-bit storage. qt_model_opts and the plan's qt_plan_opts
 * (train/plan_report.h) both hold these fields as one group: each is read by
 * its own name (o->lora_r), and the group copies whole as o->adapter (the
 * run's setup fills it once for both, train/run_setup.c). A new LoRA or
 * quantization key is one line here. */
#define QT_ADAPTER_FIELDS                                                                                              \
    int lora;              /* 0: full fine-tuning; 1: LoRA */                                                         \
    int lora_r;                                                                                                        \
    float lora_alpha;                                                                                                  \
    float lora_dropout;                                                                                                \
    unsigned lora_targets; /* QT_LORA_* mask */                                                                       \
    int use_rslora;        /* scaling alpha/sqrt(r) instead of alpha/r */                                             \
    unsigned lora_save;    /* QT_SAVE_* mask: modules_to_save (LoRA only) */                                          \
    int lora_layers_set;   /* layers_to_transform given: LoRA only in the layers of lora_layers */                    \
    uint64_t lora_layers[QT_LORA_LAYER_WORDS]; /* bit l: layer l is adapted (when lora_layers_set) */                 \
    int quant4;            /* QLoRA: the decoder layers' linear weights quantized to 4 bits as they load              \
                              (bitsandbytes' format, core/quant4.h), one tensor at a time; the embedding,             \
                              lm_head and norms stay 16-bit, as transformers keeps them. LoRA or inference only */    \
    int quant4_type;       /* qt_q4_type: QT_Q4_NF4 or QT_Q4_FP4 */                                                   \
    int quant4_nested;     /* bnb_4bit_use_double_quant: the absmax values quantized too */                          \
    unsigned quant4_skip;  /* QT_LORA_* mask of linears left 16-bit (llm_int8_skip_modules) */

typedef struct {
    QT_ADAPTER_FIELDS
} qt_adapter_opts;

/* The group inside a struct: the fields by name, and `adapter`, the same bytes as one qt_adapter_opts. */
#define QT_ADAPTER_GROUP                                                                                               \
    union {                                                                                                            \
        struct {                                                                                                       \
            QT_ADAPTER_FIELDS                                                                                          \
        };                                                                                                             \
        qt_adapter_opts adapter;                                                                                       \
    }

typedef struct {
    qt_dtype compute;     /* f32, f16 (stored half, computed f32) or bf16 */
    QT_ADAPTER_GROUP;     /* LoRA and quantization (above) */
    int grad_checkpointing; /* keep only each layer's input; recompute in backward */
    int max_B, max_T;      /* largest micro-batch: activations are sized for it once */
    uint64_t seed;         /* LoRA A init, dropout masks */
    int infer;             /* eval/generate: base frozen in its file dtype, no gradient
                              block, activations for one layer, a KV cache of max_T */
    int decode_seqs;       /* inference: sequences the KV cache holds (max_T positions
                              each), decoded together by qt_model_decode_rows; 0 means 1;
                              at most max_B * max_T */
    int keep_mapped;       /* inference without decoding (eval): the base stays in the file
                              mapping, not copied into the block a decode step streams */
    const char *backend;   /* backend/backend.h name ("cpu", "guard", "cuda"); NULL: QTUNE_BACKEND, else cpu.
                              The CLI resolves the job's "device" / --device to it (backend/device.h) */
    int device_index;      /* that backend's device (cuda: the GPU); -1: the process's default */
    int grad_windows;      /* ZeRO-2: no gradient block; each bucket's gradients are handed
                              over through a qt_grad_hook as soon as its backward is done */
    size_t grad_bucket_elems; /* with grad_windows: DeepSpeed's reduce_bucket_size, the most
                              elements one bucket of layer gradients holds; 0 = 5e8 */
    int grad_overlap;      /* with grad_windows: overlap_comm, two windows alternate (a bucket
                              is reduced while the next fills); else one */
    int master_shards;     /* full fine-tuning in f16/bf16 under ZeRO 1/2 over this many ranks (> 1):
                              the fp32 master holds only shard master_rank of the flat block
                              (core/shard.h), as DeepSpeed partitions it; see qt_model_sharded */
    int master_rank;
    int master_on_host;    /* with master_shards: the shard in pinned host memory (offload_optimizer cpu) */
    FILE *progress;        /* quantizing at load: progress lines there (core/progress.h); NULL: silent */
    int param_shards;      /* ZeRO-3 over this many ranks (> 1, = master_shards): the weights the graph
                              reads are partitioned too; each rank keeps shard master_rank of them (full:
                              the 2-byte copy, or in f32 the master itself; LoRA: the frozen base's
                              matrices, memplan.h qt_model_base_block, the adapter staying whole) and a
                              layer's are gathered before its forward and its backward (qt_param_fetch) */
    int param_on_host;     /* with param_shards: that shard in pinned host memory (offload_param cpu) */
    double param_reuse_distance; /* with param_shards: DeepSpeed's stage3_max_reuse_distance (default 1e9):
                              the V x C buffer is freed after a read when the graph reads at least this
                              many parameters before its next read (memplan.h qt_model_outer_mode) */
} qt_model_opts;

/* Whether LoRA adapts layer l (layers_to_transform), and whether the
 * embedding / the lm_head weight is trainable (full fine-tuning, or LoRA
 * with modules_to_save). */
int qt_lora_layer_on(const qt_model_opts *o, int l);
int qt_opts_trains_embed(const qt_model_opts *o);
int qt_opts_trains_lm_head(const qt_config *c, const qt_model_opts *o);

/* Defaults: f32 compute, full fine-tuning, max_B 1, max_T 512, seed 42. */
void qt_model_opts_default(qt_model_opts *o);

typedef struct qt_model qt_model;

/* Loads a model folder (config.json + safetensors). For inference only
 * (eval/generate), set opts->infer = 1 (with lora = 1 to then load an adapter
 * into the LoRA block, see model/lora_io.h). */
int qt_model_load(const char *dir, const qt_model_opts *opts, qt_model **out);
void qt_model_free(qt_model *m);
const qt_config *qt_model_config(const qt_model *m);

/* The backend the model's buffers and ops belong to (backend/backend.h):
 * the optimizer, ZeRO and the trainer use the same one. */
struct qt_backend;
struct qt_backend *qt_model_backend(const qt_model *m);

/* The trainable block and its table. Both blocks are the backend's device
 * memory: reach them through its calls (upload / download, adam,
 * sum_squares), or by name with model/params_io.h. */
size_t qt_model_numel(const qt_model *m);
float *qt_model_master(qt_model *m);   /* fp32 master weights (trainable) */
float *qt_model_grads(qt_model *m);    /* fp32 gradients; callers zero them */
const qt_param *qt_model_params(const qt_model *m, int *n);
/* After the optimizer changed the master block: refresh any compute-dtype copy
 * (sharded: this rank's range of it and of the f32 copy of the 1-D tensors;
 * the caller then all-gathers both, see qt_model_sharded). */
void qt_model_weights_updated(qt_model *m);

/* A sharded master (opts.master_shards > 1, full fine-tuning in f16/bf16):
 * qt_model_master holds the flat block's elements [lo, hi) only (element lo
 * first). The graph reads two copies that are whole on every rank: the
 * compute copy (numel elements of esize bytes) and the 1-D tensors (norm
 * weights, biases) in f32, each run of flat elements [flat, flat + n) at
 * small + at. Loading and qt_model_read_param fill both from the file on
 * every rank; after an update each rank refreshes its own range
 * (qt_model_weights_updated) and the ranks all-gather the rest. Writing the
 * trainable tensors (params_io.h) reads other ranks' ranges through gather,
 * which the caller sets: gather(user, dst, lo, n) puts flat elements
 * [lo, lo + n) into host memory dst. Returns 0 (out untouched) when the
 * master is whole. */
typedef struct {
    size_t lo, hi;
    void *wcopy;        /* params_sharded: this rank's elements only (lo first; in f32 the master) */
    size_t esize;
    float *small;
    const qt_flat_run *runs;
    int n_runs;
    int params_sharded; /* ZeRO-3 (opts.param_shards): the compute weights are gathered at use */
} qt_model_shard;
int qt_model_sharded(const qt_model *m, qt_model_shard *out);
typedef int (*qt_param_gather_fn)(void *user, float *dst, size_t lo, size_t n);
void qt_model_set_param_gather(qt_model *m, qt_param_gather_fn gather, void *user);

/* ZeRO-3 (opts.param_shards > 1): the graph reads a layer's weights from one
 * of two layer-sized buffers (layer l from buffer l & 1) and the embedding
 * and lm_head from a third (V x C); before a layer's forward, and again before
 * its backward unless the buffer still holds it, the model asks for its flat
 * range [lo, hi) of the compute weights:
 *   start(user, slot, mine, esize, lo, hi, dst): begin gathering elements
 *     [lo, hi) into dst (hi - lo elements of esize bytes) from every rank's
 *     shard (mine: this rank's, its lo first); may return before it arrived;
 *   wait(user, slot): dst of that slot (0, 1: layer buffers, 2: the V x C
 *     buffer, or with opts.param_reuse_distance 0 one lm_head vocabulary
 *     slice for its backward) holds them.
 * With prefetch the next layer's start comes before this layer computes.
 * The weights do not change between updates, so a buffer that still holds
 * the layer asked for is used again (the last two layers of a forward are
 * the first two of its backward; a tied embedding is gathered once per
 * step unless opts.param_reuse_distance frees it between uses: memplan.h
 * qt_model_outer_mode). Every rank makes the same calls in the same order. */
typedef struct {
    int (*start)(void *user, int slot, const void *mine, size_t esize, size_t lo, size_t hi, void *dst);
    int (*wait)(void *user, int slot);
    void *user;
    int prefetch;
} qt_param_fetch;
void qt_model_set_param_fetch(qt_model *m, const qt_param_fetch *f);
/* LoRA at ZeRO-3: the elements of the partitioned frozen base block, over
 * which the fetch's [lo, hi) run (sharded by core/shard.h's formula, as the
 * trainable block is); 0 when the base is whole (the fetch then runs over
 * the trainable block). */
size_t qt_model_base_sharded(const qt_model *m);
/* ZeRO-3: a rank with no batch left takes part in the gathers of another
 * rank's forward (evaluation: ranks hold different numbers of batches); a
 * no-op otherwise. */
int qt_model_forward_idle(qt_model *m);

/* Forward only: sum of the cross-entropy over labelled targets (nats) and
 * their count. Per-position log-probabilities of the targets go to logp
 * (B*T floats, 0 where unlabelled) when it is not NULL. */
int qt_model_forward(qt_model *m, const qt_batch *b, double *loss_sum, int64_t *n_tokens, float *logp);
/* Forward and backward: gradients of (sum of token losses) * grad_scale are
 * ADDED into the gradient block (accumulation across micro-batches). For the
 * token-weighted mean over a global batch of N labelled tokens with loss
 * scale S, pass grad_scale = S / N. */
int qt_model_forward_backward(qt_model *m, const qt_batch *b, float grad_scale, double *loss_sum,
                              int64_t *n_tokens);

/* Preference objectives: a forward whose per-token log-probs of the
 * targets (logp, B*T host floats, 0 where unlabelled) go to fn, which writes
 * one weight per row into row_scale (B floats); the backward then adds the
 * gradient of sum over rows r of row_scale[r] * (sum of row r's token
 * losses) into the gradient block. A row of one sequence with weight
 * -S * d objective / d log p(token) gives S times the objective's gradient.
 * fn returns QT_OK or an error, which stops the call before the backward. */
typedef int (*qt_row_weights_fn)(void *user, const float *logp, int B, int T, float *row_scale);
int qt_model_forward_backward_rows(qt_model *m, const qt_batch *b, qt_row_weights_fn fn, void *user,
                                   double *loss_sum, int64_t *n_tokens);
/* LoRA on (1, the default) or off (0): off, every forward is the base
 * model's, as PEFT's disable_adapter() (the adapter's weights stay; the
 * modules_to_save copies are still used, so a preference reference with
 * them is refused by the trainer). */
void qt_model_set_adapter(qt_model *m, int on);

/* Gradient hand-over (ZeRO-2, DeepSpeed's partitioned gradients). A model
 * loaded with opts.grad_windows allocates no gradient block
 * (qt_model_grads returns NULL); its backward produces the gradients into
 * one window (two with opts.grad_overlap) and hands them over as they are
 * done, last of the flat block first:
 *   the final norm; the lm_head in vocabulary slices (when trainable); the
 *   decoder layers' gradients in buckets (memplan.h qt_grad_pack: whole
 *   modules in the backward's order, at most opts.grad_bucket_elems each
 *   unless one module is larger, finer than a layer or spanning layers),
 *   each bucket as one ready() call per contiguous flat range in it; the
 *   embedding as rows (when trainable).
 * window(user, g, n): the model is about to zero and write g[0, n) of a
 *   window (with two windows, it was handed over two buckets ago, as several
 *   ranges): the callee waits until whatever reads any of it is done.
 * ready(user, lo, hi, g): g[0, hi - lo) holds d(loss * grad_scale) of the
 *   flat block's elements [lo, hi) for this micro-batch (not accumulated).
 * rows(user, lo, C, ids, d, n): the embedding's gradient is sparse: for each
 *   i < n, row ids[i] (elements lo + ids[i]*C ..+C) gets d[i*C .. +C] added.
 * A non-zero return stops the backward with that status. Every rank calls
 * the hooks in the same order (the units follow from the shapes alone). */
typedef struct {
    int (*window)(void *user, const float *g, size_t n);
    int (*ready)(void *user, size_t lo, size_t hi, const float *g);
    int (*rows)(void *user, size_t lo, int C, const int32_t *ids, const float *d, int n);
    void *user;
} qt_grad_hook;
void qt_model_set_grad_hook(qt_model *m, const qt_grad_hook *h);
/* Elements of one gradient window (the largest bucket or lm_head slice), 0 without windows. */
size_t qt_model_grad_window_elems(const qt_model *m);

/* Sets the counter that seeds dropout masks (incremented by every
 * qt_model_forward_backward call); a resumed run restores it. */
void qt_model_set_micro_step(qt_model *m, uint64_t step);
uint64_t qt_model_micro_step(const qt_model *m);

/* Incremental decoding with a KV cache (inference models, opts->infer = 1):
 * runs the n tokens ids at positions pos0 .. pos0+n-1 (B = 1) of sequence 0,
 * attending to the cached positions [0, pos0) plus themselves, stores their
 * K/V, and writes the V logits of the last one to logits_out. pos0 may not
 * exceed the number of cached positions (pass 0 to start over), and pos0 + n
 * <= opts->max_T, n <= max_B * max_T. One token (n = 1) runs every Linear as
 * a matrix-vector product (qt_be_matvec), the batched forward otherwise. */
int qt_model_decode(qt_model *m, const int32_t *ids, int n, int pos0, float *logits_out);
/* The same for sequence seq of the KV cache (0 <= seq < opts->decode_seqs). */
int qt_model_decode_seq(qt_model *m, int seq, const int32_t *ids, int n, int pos0, float *logits_out);
/* One decode step of n sequences together (n <= opts->decode_seqs): row i is
 * token ids[i] of sequence seqs[i] (distinct) at position pos[i] (at most
 * that sequence's cached positions). Every Linear reads its weight once for
 * the n rows (qt_be_matvec with N = n); logits_out gets n rows of V. Row i's
 * logits are the same bits qt_model_decode_seq gives that one token. */
int qt_model_decode_rows(qt_model *m, int n, const int *seqs, const int32_t *ids, const int32_t *pos,
                         float *logits_out);
void qt_model_decode_reset(qt_model *m);

#endif
