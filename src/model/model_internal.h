/* The model's insides, shared by the files of src/model/ (graph, memory plan,
 * LoRA I/O). Nothing outside src/model/ includes this. */
#ifndef QT_MODEL_INTERNAL_H
#define QT_MODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "io/safetensors.h"
#include "core/progress.h"
#include "model/grad_windows.h"
#include "model/memplan.h"
#include "model/model.h"

/* The seven Linear layers of a decoder layer, in PEFT's names. */
enum { LIN_Q, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, LIN_COUNT };
extern const char *const qt_lin_path[LIN_COUNT];   /* "self_attn.q_proj", ... */
extern const char *const qt_lin_short[LIN_COUNT];  /* "q_proj", ... */
extern const unsigned qt_lin_flag[LIN_COUNT];      /* QT_LORA_Q, ... */
void qt_lin_shape(const qt_config *c, int which, int *in, int *out);
int qt_lin_has_bias(const qt_config *c, int which); /* q/k/v with attention_bias */
/* The layout's module path of linear `which` ("self_attn.q_proj", or the
 * original Qwen's "attn.c_attn" for q, k and v). With a fused q/k/v
 * (qt_layout.fused_qkv) the three are row slices of one tensor: its rows
 * (qt_lin_fused_rows) and where `which` starts (qt_lin_row0, 0 unfused). */
const char *qt_lin_name(const qt_config *c, int which);
int qt_lin_row0(const qt_config *c, int which);
int qt_lin_fused_rows(const qt_config *c);
/* 1 when `which` is the first linear of its module (the one that owns the fused tensor and its LoRA);
 * 0 for k and v when fused. */
int qt_lin_owns(const qt_config *c, int which);

/* A weight as stored: f32 master, or a frozen base tensor in its file dtype. */
typedef struct {
    const void *p;
    qt_dtype dt;
} qt_wref;

typedef struct {
    int in, out;
    qt_wref w;          /* (out, in) */
    const float *b;     /* (out) or NULL */
    float *dw, *db;     /* full fine-tuning: into the gradient block; else NULL */
    float *la, *lb;     /* LoRA A (R, in), B (out, R) in the master block; NULL when not a target.
                           Fused q/k/v (original Qwen's c_attn): one A shared by q, k and v, and each
                           lb a row slice of one B, as PEFT adapts the whole fused module */
    float *dla, *dlb;
    int lora_id;        /* the LoRA module's index for dropout masks: which, or LIN_Q for a fused k/v */
} qt_linear;

typedef struct {
    const float *ln1, *ln2; /* (C) */
    float *dln1, *dln2;     /* NULL when frozen */
    const float *qn, *kn;   /* Qwen3 q_norm / k_norm (D), NULL without qk_norm */
    float *dqn, *dkn;       /* NULL when frozen */
    qt_linear lin[LIN_COUNT];
} qt_layer;

/* What one layer's forward leaves for its backward. */
typedef struct {
    float *ln1;   /* (N, C) */
    float *rstd1; /* (N) */
    float *q;     /* (N, H*D) after RoPE */
    float *k, *v; /* (N, KV*D), k after RoPE */
    float *qraw, *kraw;   /* qk_norm: (N, H*D), (N, KV*D) the projections before the norm, else NULL */
    float *rstdq, *rstdk; /* qk_norm: (N*H), (N*KV) */
    float *att;   /* (N, H*D) attention output before o_proj */
    float *lse;   /* (B, H, T) */
    float *xmid;  /* (N, C) x + o_proj(att) */
    float *ln2;   /* (N, C) */
    float *rstd2; /* (N) */
    float *gate, *up, *h; /* (N, I) */
    float *lora_h[LIN_COUNT]; /* (N, R) scaling * A dropout(x), NULL when not a target */
} qt_acts;

/* f16/bf16 training without checkpointing: the 2-byte slots (fp16 / bf16 bit
 * patterns) that hold what a layer's forward saves, one set per layer. The
 * layer itself computes in an fp32 working set shared by all layers (the
 * float pointers of qt_acts, except the small fp32 rstd1/lse/rstd2 which stay
 * per layer): the forward rounds each value and stores it here in the same
 * pass, the backward converts a layer's slots back just before using them. */
typedef struct {
    uint16_t *ln1, *q, *k, *v, *att, *xmid, *ln2, *gate, *up, *h; /* shapes as in qt_acts */
    uint16_t *qraw, *kraw;                                        /* qk_norm only, else NULL */
    uint16_t *lora_h[LIN_COUNT];                                  /* NULL when not a target */
} qt_acts16;

/* Activation-gradient scratch for the backward, shared by all layers. */
typedef struct {
    float *dres;  /* (N, C) gradient of the residual stream */
    float *dln;   /* (N, C) */
    float *datt;  /* (N, H*D) */
    float *dq;    /* (N, H*D) */
    float *dk, *dv; /* (N, KV*D) */
    float *dg, *du, *dh; /* (N, I) */
    float *dlora; /* (N, R) */
    float *lx;    /* (N, max in) dropout(x) and its gradient (LoRA with dropout) */
    uint16_t *dout16; /* (N, max out) bf16 training without checkpointing: a linear's dout as bf16 */
} qt_grad_scratch;

/* Sizes (in floats) and carving of the activation blocks. base NULL: size only. */
typedef struct {
    float **x;          /* L+1 pointers, each (N, C): layer inputs, x[L] the last output; with 2-byte
                           storage two fp32 buffers alternate (x[l] = x[l & 1] ...) */
    qt_acts *layer;     /* L entries; with checkpointing/inference all alias one set */
    float *lnf, *rstdf; /* (N, C), (N) */
    float *loss, *lse;  /* (N), (N) */
    /* f16/bf16 training only (qt_model_acts_2byte), else NULL: */
    uint16_t **x16;     /* L pointers, each (N, C): layer inputs in the compute dtype */
    qt_acts16 *layer16; /* L entries, NULL with checkpointing (the one fp32 set is recomputed) */
} qt_act_ptrs;
/* 1 when saved activations are stored in 2 bytes: training in f16/bf16. */
int qt_model_acts_2byte(const qt_model_opts *o);
/* base NULL: size only; with 2-byte storage p->x16 and p->layer16 must point at tables of L entries */
size_t qt_model_carve_acts(const qt_config *c, const qt_model_opts *o, float *base, qt_act_ptrs *p);
size_t qt_model_carve_grads(const qt_config *c, const qt_model_opts *o, float *base, qt_grad_scratch *g);
size_t qt_model_workspace_floats(const qt_config *c, const qt_model_opts *o);
/* Full fine-tuning: the forward keeps the lm_head's logits in the workspace,
 * at qt_model_kept_logits_offset floats, for the backward (rule in memplan.c). */
int qt_model_keeps_logits(const qt_config *c, const qt_model_opts *o);
/* Inference copies the matrices a decode step reads into one block (the
 * stream block); on the cpu backend only where bytes fit, with a 1 GiB
 * margin, in avail_kib of available memory (MemAvailable; -1: unknown, it
 * fits). Else they stay in the file mapping. */
int qt_model_stream_fits(size_t bytes, long long avail_kib);
size_t qt_model_kept_logits_offset(const qt_config *c, const qt_model_opts *o);
/* Inference: the KV cache, K then V, each (L, decode_seqs, max_T, KV, D);
 * base NULL: size only (k, v may be NULL). Returns floats. */
size_t qt_model_carve_kv(const qt_config *c, const qt_model_opts *o, float *base, float **k, float **v);
size_t qt_model_kv_floats(const qt_config *c, const qt_model_opts *o);
/* A batch's int32 arrays in device memory, each max_B * max_T (upload_batch;
 * decoding uses inputs and positions). Small, and not in the plan's total. */
typedef struct {
    int32_t *inputs, *targets, *positions, *doc_start;
} qt_batch_ids;
size_t qt_model_carve_ids(const qt_model_opts *o, float *base, qt_batch_ids *p);

/* dst[0..n) = src * the LoRA dropout mask of (layer l, module j) at the
 * model's current micro step, scaled by 1/(1-p), on the model's backend
 * (device pointers; dst may be src): the mask the next
 * qt_model_forward_backward uses (tests dump it to check PEFT parity). */
void qt_lora_dropout(const qt_model *m, int l, int j, float *dst, const float *src, size_t n);

/* Every float / uint16_t buffer below is device memory of m->be (the
 * backend's own; the host reaches it only through upload / download), except
 * where a comment says host. */
/* params_io.c's producer context of one parameter */
typedef struct {
    const struct qt_model *m;
    size_t offset;
} qt_param_src;
/* A file tensor into device memory as f32, through host staging (params_io.c). */
int qt_model_read_to_device(struct qt_model *m, const st_tensor *t, float *dev);

/* RoPE's inverse frequencies (D/2 floats into inv) for a call whose largest
 * position is max_pos (dynamic scaling depends on it), as transformers'
 * modeling_rope_utils computes them for c->rope_scaling, and the factor cos
 * and sin are multiplied by (YaRN's attention_factor, else 1) (rope.c). */
void qt_rope_inv_freq(const qt_config *c, int D, int32_t max_pos, float *inv, float *attention_factor);

/* A sharded master's f32 copy of the 1-D tensor at flat offset `offset`, or NULL (params_io.c). */
float *qt_model_small_of(const struct qt_model *m, size_t offset);

/* The model's RoPE table for positions up to max_pos (m->rope_inv, m->rope_scale). */
void qt_model_rope_table(struct qt_model *m, int32_t max_pos);

struct qt_model {
    qt_backend *be;       /* the backend every op and buffer belongs to */
    int own_be;           /* opened by qt_model_load (closed by qt_model_free) */
    qt_config cfg;
    qt_model_opts opts;
    int infer;            /* no gradients, KV cache */
    st_file *st;          /* the base's safetensors, mapped for the model's lifetime */
    qt_mem_breakdown mem;

    float *master, *grads; /* trainable block and gradients (grads NULL for inference and
                              with gradient windows); the master holds [mlo, mhi) of the block */
    size_t mlo, mhi;       /* [0, numel) unless sharded */
    int sharded;           /* opts.master_shards > 1 (model.h qt_model_sharded): the graph reads
                              wcopy and small, never the master */
    float *small;          /* sharded: (n_small) the 1-D tensors in f32, whole */
    qt_flat_run *small_runs; /* sharded: each 1-D tensor's flat range and place in small */
    int n_small_runs;
    size_t n_small;
    /* ZeRO-3 (opts.param_shards > 1, model.h qt_param_fetch): wcopy holds only [mlo, mhi) (f16/bf16; in
     * f32 the master is that shard); the graph reads layer l from gbuf[l & 1] and the embedding and
     * lm_head from gbuf[2], filled by gathers of their flat ranges */
    int pshard;
    void *gbuf[3];
    size_t *glo, *ghi;     /* (L) layer l's flat range [glo[l], ghi[l]) */
    size_t emb_off;        /* the embedding's flat offset */
    long long gkey[3];     /* what each buffer holds: a layer index, or (buffer 2) a flat offset; -1: nothing */
    int gpend[3];          /* a gather into that buffer is in flight (prefetch) */
    qt_param_fetch pf;
    size_t gout[2];        /* buffer 2's flat offset for the embedding [0] and the lm_head [1]; -1: not gathered */
    int gmode;             /* memplan.h qt_model_outer_mode: QT_OUTER_KEPT, or buffer 2 freed after reads */
    void *gslice;          /* QT_OUTER_SLICED: one lm_head vocabulary slice, gathered for its backward */
    /* LoRA at ZeRO-3 (memplan.h qt_model_base_block): what is partitioned is the frozen base; pbase holds this
     * rank's [blo, bhi) of that block of bn elements in bdt; bcur places each matrix as it loads (blayer: the
     * layer loading, -1 for the vocabulary matrices) */
    void *pbase;
    size_t bn, blo, bhi, bcur;
    qt_dtype bdt;
    int blayer;
    qt_param_gather_fn gather; /* sharded: other ranks' master elements, for writing */
    void *gather_user;
    /* opts.grad_windows (model.h qt_grad_hook): the gradient windows and their buckets (grad_windows.h);
     * dwte/dlm_head only mark the embedding/lm_head trainable then. grad_win.block NULL: none. */
    qt_grad_win_state grad_win;
    size_t numel;
    qt_param *params;
    qt_param_src *param_src; /* (n_params) */
    int n_params;

    float *base_f32;       /* frozen base: norm weights and biases in f32 */
    uint16_t *wcopy;       /* full fine-tuning in f16/bf16: (numel) compute copy of master,
                              read by the matmuls, refreshed by qt_model_weights_updated */
    void **owned;          /* frozen tensors allocated here (compute-dtype copies, misaligned f32) */
    int n_owned;
    const void **imported; /* frozen tensors imported from the mapping (qt_be_import_mapped) */
    int n_imported;
    char *stream_block;    /* inference: one block holding the matrices a decode step reads whole */
    size_t stream_size, stream_used;
    size_t quant_bytes;   /* 4-bit blocks of the base (opts.quant4) */
    size_t quant_src_bytes; /* ... and the 16-bit (file) bytes they came from */
    qt_progress quant_prog; /* quantizing at load */
    int quant_done;
    const char *dir;      /* the folder, while qt_model_load runs (messages); NULL after */

    qt_wref wte;           /* (V, C) */
    qt_wref lm_head;       /* (V, C), the embedding when tied */
    float *dwte, *dlm_head;
    size_t lm_head_off;    /* the trainable lm_head's offset in the flat block (the embedding's when tied) */
    const float *lnf_w;    /* (C) */
    float *dlnf_w;
    qt_layer *layers;      /* L */
    float lora_scaling;

    float *act_block, *grad_block, *ws;
    qt_act_ptrs acts;
    qt_grad_scratch gs;
    int32_t *pos_buf;      /* host (max N) positions for decoding */
    float rope_inv[QT_ROPE_MAX_HALF]; /* host RoPE table of the current forward (qt_rope_inv_freq: upload_batch,
                                         qt_model_decode), read by qt_be_rope_forward / _backward */
    float rope_scale;      /* its cos/sin factor (YaRN's attention factor, else 1) */
    float *ids_block;      /* qt_model_carve_ids: */
    qt_batch_ids ids;      /* a batch's inputs, targets, positions, doc_start (upload_batch) */
    float *loss_host;      /* host (max N) per-token losses, downloaded */
    float *logits;         /* (decode_seqs, V) decode logits, inference only */

    float *kv_block;       /* inference only: the KV cache (qt_model_carve_kv), */
    float *kcache, *vcache; /* its halves, (L, decode_seqs, max_T, KV, D) each */
    int *kv_len;           /* host (decode_seqs) cached positions of each sequence */
    int decode_seqs;       /* opts.decode_seqs, at least 1 */
    int dec_rows;          /* a qt_model_decode_rows step is running: its rows are one token of
                              each sequence, and every Linear runs on qt_be_matvec */

    uint64_t micro_step;   /* forward_backward calls so far: the dropout stream */
    int adapter_off;       /* qt_model_set_adapter(m, 0): the LoRA products are skipped (the base model) */
    int native16;          /* 16-bit training (bf16 or f16, without checkpointing) where the backend has
                              that dtype's GEMM (qt_be_half_available: oneDNN's bf16 on a CPU with
                              AVX512_BF16, the GPU's tensor cores): the layers' base matmuls run on it */
    int infer16;           /* inference (fp32 compute) on bf16-valued layer weights (bf16, or 4-bit
                              dequantizing to bf16) where the backend has the bf16 GEMM: a batched
                              forward rounds each Linear's input to bf16 first, as the PyTorch bf16
                              model holds its activations, so the product runs on that GEMM */
};

#endif
