/* The memory plan: the one table that sizes every block the model allocates.
 * qt_model_load carves its buffers with the same functions it sizes them
 * with (base == NULL: size only), so the plan cannot drift from the truth. */
#include "model/memplan.h"

#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"
#include "core/quant4.h"
#include "model/model_internal.h"

/* The plan reads only the backend's descriptor (plain facts: chunk sizes,
 * workspace caps), so it answers for a backend whose device is not here. An
 * unknown name plans as the cpu. */
static const qt_backend_desc *desc_of(const qt_model_opts *o) {
    const qt_backend_desc *d = qt_backend_desc_of(o->backend);
    return d ? d : qt_backend_desc_of("cpu");
}

/* The process runtime outside the planned blocks (backend.h; the CPU's
 * figure, more with oneDNN's sgemm in use), without opening a backend. */
size_t qt_model_cpu_runtime_bytes(void) { return qt_backend_host_runtime_bytes(); }

const char *const qt_lin_path[LIN_COUNT] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                            "mlp.down_proj"};
const char *const qt_lin_short[LIN_COUNT] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"};
const unsigned qt_lin_flag[LIN_COUNT] = {QT_LORA_Q,    QT_LORA_K,  QT_LORA_V,   QT_LORA_O,
                                         QT_LORA_GATE, QT_LORA_UP, QT_LORA_DOWN};

void qt_lin_shape(const qt_config *c, int which, int *in, int *out) {
    int C = c->hidden_size, I = c->intermediate_size;
    int HD = c->num_attention_heads * c->head_dim, KVD = c->num_key_value_heads * c->head_dim;
    switch (which) {
    case LIN_Q: *in = C, *out = HD; break;
    case LIN_K:
    case LIN_V: *in = C, *out = KVD; break;
    case LIN_O: *in = HD, *out = C; break;
    case LIN_GATE:
    case LIN_UP: *in = C, *out = I; break;
    default: *in = I, *out = C; break;
    }
}

int qt_lin_has_bias(const qt_config *c, int which) {
    return c->attention_bias && (which == LIN_Q || which == LIN_K || which == LIN_V);
}

const char *qt_lin_name(const qt_config *c, int which) { return qt_config_layout(c)->lin[which]; }

int qt_lin_fused_rows(const qt_config *c) {
    return (c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
}

/* c_attn's rows: q (H*D), then k (KV*D), then v (modeling_qwen.py splits the output in that order) */
int qt_lin_row0(const qt_config *c, int which) {
    if (!qt_config_layout(c)->fused_qkv) return 0;
    int q = c->num_attention_heads * c->head_dim, kv = c->num_key_value_heads * c->head_dim;
    return which == LIN_K ? q : which == LIN_V ? q + kv : 0;
}

int qt_lin_owns(const qt_config *c, int which) {
    return !(qt_config_layout(c)->fused_qkv && (which == LIN_K || which == LIN_V));
}

static int lora_on(const qt_model_opts *o, int which) {
    return o->lora && (o->lora_targets & qt_lin_flag[which]);
}

int qt_lora_layer_on(const qt_model_opts *o, int l) {
    if (!o->lora_layers_set) return 1;
    return l >= 0 && l < QT_LORA_MAX_LAYERS && (o->lora_layers[l / 64] >> (l % 64) & 1);
}

int qt_opts_trains_embed(const qt_model_opts *o) { return !o->lora || (o->lora_save & QT_SAVE_EMBED); }

int qt_opts_trains_lm_head(const qt_config *c, const qt_model_opts *o) {
    (void)c; /* full fine-tuning trains the lm_head, tied or not */
    return !o->lora || (o->lora_save & QT_SAVE_LM_HEAD);
}

/* The model's embedding / lm_head under PEFT's modules_to_save: the
 * ModulesToSaveWrapper's state-dict key with modules_to_save.default taken
 * out, as get_peft_model_state_dict writes it. */
void qt_saved_module_name(const qt_config *c, unsigned which, char *out, size_t cap) {
    if (which == QT_SAVE_EMBED) snprintf(out, cap, "base_model.model.%s.weight", qt_config_layout(c)->embed);
    else snprintf(out, cap, "base_model.model.lm_head.weight");
}

/* Where a parameter sits: its decoder layer (-1 outside the layers) and the
 * backward step that completes its gradient (memplan.h QT_GU_*). */
typedef struct {
    int layer, unit;
} param_where;

static void add_param(qt_param *out, int *n, size_t *off, param_where w, const char *name, int ndim, int64_t d0,
                      int64_t d1) {
    if (out) {
        qt_param *p = &out[*n];
        memset(p, 0, sizeof *p);
        snprintf(p->name, sizeof p->name, "%s", name);
        p->ndim = ndim;
        p->shape[0] = d0;
        p->shape[1] = ndim == 2 ? d1 : 0;
        p->offset = *off;
        p->numel = (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
        p->decay = ndim == 2;
        p->layer = w.layer;
        p->unit = w.unit;
    }
    *off += (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    (*n)++;
}

/* Full fine-tuning: every tensor of the file, in its order; LoRA: A and B
 * of each adapted module. Names come from the architecture's layout; a fused
 * q/k/v is one tensor (and one adapted module) listed at q. */
static const int lin_unit[LIN_COUNT] = {QT_GU_Q, QT_GU_K, QT_GU_V, QT_GU_O, QT_GU_GATE, QT_GU_UP, QT_GU_DOWN};

int qt_model_param_table(const qt_config *c, const qt_model_opts *o, qt_param *out, size_t *numel) {
    int n = 0;
    size_t off = 0;
    char name[160];
    const qt_layout *ly = qt_config_layout(c);
    int C = c->hidden_size, V = c->vocab_size, R = o->lora_r, D = c->head_dim;
    param_where w = {-1, -1};
    if (!o->lora) {
        snprintf(name, sizeof name, "%s.weight", ly->embed);
        add_param(out, &n, &off, w, name, 2, V, C);
    } else if (o->lora_save & QT_SAVE_EMBED) { /* modules_to_save: the embedding first, as full fine-tuning */
        qt_saved_module_name(c, QT_SAVE_EMBED, name, sizeof name);
        add_param(out, &n, &off, w, name, 2, V, C);
    }
    for (int l = 0; l < c->num_hidden_layers; l++) {
        w.layer = l;
        if (!o->lora) {
            w.unit = QT_GU_LN1;
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln1);
            add_param(out, &n, &off, w, name, 1, C, 0);
        }
        for (int j = 0; j < LIN_COUNT; j++) {
            if (!qt_lin_owns(c, j)) continue;
            int in, ou;
            qt_lin_shape(c, j, &in, &ou);
            if (ly->fused_qkv && j == LIN_Q) ou = qt_lin_fused_rows(c);
            w.unit = lin_unit[j];
            if (!o->lora) {
                snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->lin[j]);
                add_param(out, &n, &off, w, name, 2, ou, in);
                if (qt_lin_has_bias(c, j)) {
                    snprintf(name, sizeof name, "%s.%d.%s.bias", ly->layers, l, ly->lin[j]);
                    add_param(out, &n, &off, w, name, 1, ou, 0);
                }
                if (j == LIN_K && ly->q_norm) { /* Qwen3: q_norm, k_norm after the projections */
                    w.unit = QT_GU_Q;
                    snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->q_norm);
                    add_param(out, &n, &off, w, name, 1, D, 0);
                    w.unit = QT_GU_K;
                    snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->k_norm);
                    add_param(out, &n, &off, w, name, 1, D, 0);
                }
                if (j == LIN_O) {
                    w.unit = QT_GU_LN2;
                    snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln2);
                    add_param(out, &n, &off, w, name, 1, C, 0);
                }
            } else if (lora_on(o, j) && qt_lora_layer_on(o, l)) {
                snprintf(name, sizeof name, "base_model.model.%s.%d.%s.lora_A.weight", ly->layers, l, ly->lin[j]);
                add_param(out, &n, &off, w, name, 2, R, in);
                snprintf(name, sizeof name, "base_model.model.%s.%d.%s.lora_B.weight", ly->layers, l, ly->lin[j]);
                add_param(out, &n, &off, w, name, 2, ou, R);
            }
        }
    }
    w = (param_where){-1, -1};
    if (!o->lora) {
        snprintf(name, sizeof name, "%s.weight", ly->final_norm);
        add_param(out, &n, &off, w, name, 1, C, 0);
        if (!c->tie_word_embeddings) add_param(out, &n, &off, w, "lm_head.weight", 2, V, C);
    } else if (o->lora_save & QT_SAVE_LM_HEAD) { /* its own copy even when tied (PEFT's wrapper) */
        qt_saved_module_name(c, QT_SAVE_LM_HEAD, name, sizeof name);
        add_param(out, &n, &off, w, name, 2, V, C);
    }
    if (numel) *numel = off;
    return n;
}

size_t qt_model_trainable_numel(const qt_config *cfg, const qt_model_opts *opts) {
    size_t n;
    qt_model_param_table(cfg, opts, NULL, &n);
    return n;
}

/* Hands out n floats from the block at *off (64-byte aligned slices). */
static float *carve(float *base, size_t *off, size_t n) {
    float *p = base ? base + *off : NULL;
    *off += (n + 15) & ~(size_t)15;
    return p;
}

static size_t max_n(const qt_model_opts *o) { return (size_t)o->max_B * (size_t)o->max_T; }

int qt_model_layer_unit(const qt_model_opts *o, int l) {
    if (o->lora && !qt_lora_layer_on(o, l)) return -1;
    if (!o->lora_layers_set || !o->lora) return l;
    int k = 0;
    for (int i = 0; i < l; i++) k += qt_lora_layer_on(o, i);
    return k;
}

/* Every decoder layer with trainable tensors has the same ones in the same
 * order (LoRA's layers_to_transform leaves the others with none): the units'
 * sizes come from a one-layer table of an adapted layer, without the
 * modules_to_save (outside the layers). */
static int layer_units(const qt_config *c, const qt_model_opts *o, size_t units[QT_GU_COUNT]) {
    qt_config c1 = *c;
    c1.num_hidden_layers = 1;
    qt_model_opts one = *o;
    one.lora_layers_set = 0; /* one layer's tensors: an adapted layer's */
    one.lora_save = 0;
    qt_param t[32]; /* one layer: at most 15 tensors (full) or 14 (LoRA A/B of 7 modules) */
    int n = qt_model_param_table(&c1, &one, NULL, NULL);
    if (n > (int)(sizeof t / sizeof t[0])) return 0;
    qt_model_param_table(&c1, &one, t, NULL);
    memset(units, 0, QT_GU_COUNT * sizeof units[0]);
    for (int i = 0; i < n; i++)
        if (t[i].layer == 0) units[t[i].unit] += t[i].numel;
    return 1;
}

static size_t grad_bucket(const qt_model_opts *o) {
    return o->grad_bucket_elems ? o->grad_bucket_elems : QT_GRAD_BUCKET_DEFAULT;
}

/* DeepSpeed fills its bucket with parameters as their gradients are ready and
 * reduces it when the next would overflow it; here the parameters of one
 * backward step go together (one op writes them), in the backward's order.
 * A layer layers_to_transform leaves out has no gradients: it is in no bucket. */
int qt_grad_pack(const qt_config *c, const qt_model_opts *o, int *unit_bucket, size_t *most) {
    size_t units[QT_GU_COUNT], S = grad_bucket(o), fill = 0, big = 0;
    int nb = 0;
    if (most) *most = 0;
    if (!layer_units(c, o, units)) return 0;
    for (int l = c->num_hidden_layers - 1; l >= 0; l--) {
        const int on = qt_model_layer_unit(o, l) >= 0;
        for (int k = 0; k < QT_GU_COUNT; k++) {
            int b = -1;
            if (on && units[k]) {
                if (nb == 0 || (fill > 0 && fill + units[k] > S)) nb++, fill = 0;
                fill += units[k];
                if (fill > big) big = fill;
                b = nb - 1;
            }
            if (unit_bucket) unit_bucket[(size_t)l * QT_GU_COUNT + (size_t)k] = b;
        }
    }
    if (most) *most = big;
    return nb;
}

/* The layer gradients go in buckets (qt_grad_pack). The lm_head slices are
 * whole vocabulary chunks of the backend's ce_chunk (so the op walks the same
 * chunks as unsliced), rounded up from the largest bucket: the windows then
 * hold max(bucket, slice) each, whatever the vocabulary. The embedding and
 * the lm_head are trainable in full fine-tuning and as LoRA's modules_to_save;
 * the final norm only in full fine-tuning. */
void qt_model_grad_windows(const qt_config *c, const qt_model_opts *o, qt_grad_windows *w) {
    memset(w, 0, sizeof *w);
    if (o->infer || !o->grad_windows) return;
    size_t units[QT_GU_COUNT];
    if (layer_units(c, o, units))
        for (int k = 0; k < QT_GU_COUNT; k++) w->layer += units[k];
    w->nbuckets = qt_grad_pack(c, o, NULL, &w->bucket);
    w->nwin = o->grad_overlap ? 2 : 1;
    size_t C = (size_t)c->hidden_size;
    w->layer0 = qt_opts_trains_embed(o) ? (size_t)c->vocab_size * C : 0;
    w->norm = o->lora ? 0 : C; /* the final norm is frozen under LoRA */
    if (qt_opts_trains_lm_head(c, o)) {
        const size_t ch = (size_t)desc_of(o)->ce_chunk;
        size_t rows = (w->bucket / C + ch - 1) / ch * ch;
        if (rows < ch) rows = ch;
        if (rows > (size_t)c->vocab_size) rows = (size_t)c->vocab_size;
        w->slice_rows = (int)rows;
        w->slice = rows * C;
        w->targets = max_n(o);
    }
    /* the lm_head's slices run before the first layer: they share the windows */
    w->each = w->bucket > w->slice ? w->bucket : w->slice;
    w->total = qt_model_carve_windows(w, NULL, NULL);
}

size_t qt_model_carve_windows(const qt_grad_windows *w, float *base, qt_grad_window_ptrs *p) {
    qt_grad_window_ptrs s = {{NULL, NULL}, NULL, NULL};
    size_t off = 0;
    for (int i = 0; i < w->nwin; i++) s.win[i] = w->each ? carve(base, &off, w->each) : NULL;
    s.norm = w->norm ? carve(base, &off, w->norm) : NULL;
    s.targets = w->targets ? (int32_t *)carve(base, &off, w->targets) : NULL; /* int32 in float slots */
    if (p) *p = s;
    return off;
}

static void carve_layer(const qt_config *c, const qt_model_opts *o, float *base, size_t *off, qt_acts *a) {
    size_t N = max_n(o), C = c->hidden_size, I = c->intermediate_size;
    size_t HD = (size_t)c->num_attention_heads * c->head_dim, KVD = (size_t)c->num_key_value_heads * c->head_dim;
    a->ln1 = carve(base, off, N * C);
    a->rstd1 = carve(base, off, N);
    a->q = carve(base, off, N * HD);
    a->k = carve(base, off, N * KVD);
    a->v = carve(base, off, N * KVD);
    if (c->qk_norm) {
        a->qraw = carve(base, off, N * HD);
        a->kraw = carve(base, off, N * KVD);
        a->rstdq = carve(base, off, N * c->num_attention_heads);
        a->rstdk = carve(base, off, N * c->num_key_value_heads);
    } else {
        a->qraw = a->kraw = a->rstdq = a->rstdk = NULL; /* the graph tests these: never left unset */
    }
    a->att = carve(base, off, N * HD);
    a->lse = carve(base, off, N * c->num_attention_heads);
    a->xmid = carve(base, off, N * C);
    a->ln2 = carve(base, off, N * C);
    a->rstd2 = carve(base, off, N);
    a->gate = carve(base, off, N * I);
    a->up = carve(base, off, N * I);
    a->h = carve(base, off, N * I);
    for (int j = 0; j < LIN_COUNT; j++)
        a->lora_h[j] = lora_on(o, j) ? carve(base, off, N * (size_t)o->lora_r) : NULL;
}

int qt_model_acts_2byte(const qt_model_opts *o) { return !o->infer && o->compute != QT_F32; }

/* Hands out n 2-byte values from the float block (64-byte aligned slices). */
static uint16_t *carve16(float *base, size_t *off, size_t n) { return (uint16_t *)carve(base, off, (n + 1) / 2); }

static void carve_layer16(const qt_config *c, const qt_model_opts *o, float *base, size_t *off, qt_acts16 *s) {
    size_t N = max_n(o), C = c->hidden_size, I = c->intermediate_size;
    size_t HD = (size_t)c->num_attention_heads * c->head_dim, KVD = (size_t)c->num_key_value_heads * c->head_dim;
    s->ln1 = carve16(base, off, N * C);
    s->q = carve16(base, off, N * HD);
    s->k = carve16(base, off, N * KVD);
    s->v = carve16(base, off, N * KVD);
    s->qraw = c->qk_norm ? carve16(base, off, N * HD) : NULL;
    s->kraw = c->qk_norm ? carve16(base, off, N * KVD) : NULL;
    s->att = carve16(base, off, N * HD);
    s->xmid = carve16(base, off, N * C);
    s->ln2 = carve16(base, off, N * C);
    s->gate = carve16(base, off, N * I);
    s->up = carve16(base, off, N * I);
    s->h = carve16(base, off, N * I);
    for (int j = 0; j < LIN_COUNT; j++)
        s->lora_h[j] = lora_on(o, j) ? carve16(base, off, N * (size_t)o->lora_r) : NULL;
}

/* fp32: x[0..L] and every layer's qt_acts (one set with checkpointing or
 * inference). f16/bf16 training: two fp32 x buffers and one fp32 layer set
 * (the working set), each layer's rstd1/lse/rstd2 in fp32, and in 2 bytes
 * the layer inputs x16[0..L) and, without checkpointing, every layer's
 * qt_acts16. x[L] needs no 2-byte copy: it is still in its fp32 buffer when
 * the final norm's backward reads it. */
size_t qt_model_carve_acts(const qt_config *c, const qt_model_opts *o, float *base, qt_act_ptrs *p) {
    size_t off = 0, N = max_n(o), C = c->hidden_size;
    int L = c->num_hidden_layers;
    int one_set = o->grad_checkpointing || o->infer, two = qt_model_acts_2byte(o);
    for (int l = 0; l <= L; l++) {
        /* inference and 2-byte storage need only the current input and output in fp32 */
        float *x = ((o->infer || two) && l > 1) ? (p ? p->x[l & 1] : NULL) : carve(base, &off, N * C);
        if (p) p->x[l] = x;
    }
    for (int l = 0; two && l < L; l++) {
        uint16_t *x16 = carve16(base, &off, N * C);
        if (p) p->x16[l] = x16;
    }
    qt_acts work;
    memset(&work, 0, sizeof work);
    for (int l = 0; l < L; l++) {
        qt_acts a;
        if (l == 0 || !(one_set || two)) {
            carve_layer(c, o, base, &off, &a);
            work = a;
        } else {
            a = work;
        }
        if (two && !one_set) {
            if (l > 0) {
                a.rstd1 = carve(base, &off, N);
                a.lse = carve(base, &off, N * c->num_attention_heads);
                a.rstd2 = carve(base, &off, N);
                if (c->qk_norm) {
                    a.rstdq = carve(base, &off, N * c->num_attention_heads);
                    a.rstdk = carve(base, &off, N * c->num_key_value_heads);
                }
            }
            qt_acts16 s;
            carve_layer16(c, o, base, &off, &s);
            if (p) p->layer16[l] = s;
        }
        if (p) p->layer[l] = a;
    }
    float *lnf = carve(base, &off, N * C), *rstdf = carve(base, &off, N);
    float *loss = carve(base, &off, N), *lse = carve(base, &off, N);
    if (p) p->lnf = lnf, p->rstdf = rstdf, p->loss = loss, p->lse = lse;
    return off;
}

size_t qt_model_carve_grads(const qt_config *c, const qt_model_opts *o, float *base, qt_grad_scratch *g) {
    if (o->infer) return 0;
    size_t off = 0, N = max_n(o), C = c->hidden_size, I = c->intermediate_size;
    size_t HD = (size_t)c->num_attention_heads * c->head_dim, KVD = (size_t)c->num_key_value_heads * c->head_dim;
    qt_grad_scratch s;
    s.dres = carve(base, &off, N * C);
    s.dln = carve(base, &off, N * C);
    s.datt = carve(base, &off, N * HD);
    s.dq = carve(base, &off, N * HD);
    s.dk = carve(base, &off, N * KVD);
    s.dv = carve(base, &off, N * KVD);
    s.dg = carve(base, &off, N * I);
    s.du = carve(base, &off, N * I);
    s.dh = carve(base, &off, N * I);
    s.dlora = o->lora ? carve(base, &off, N * (size_t)o->lora_r) : NULL;
    size_t maxin = C > I ? C : I;
    if (HD > maxin) maxin = HD;
    s.lx = (o->lora && o->lora_dropout > 0) ? carve(base, &off, N * maxin) : NULL;
    /* 16-bit with every layer's inputs saved in 2 bytes: a linear's output gradient in 2 bytes, the A
     * operand of the backward's 16-bit GEMMs where the backend has them (qwen2.c base_backward; f16 only
     * where the descriptor lists f16 as native, the GPU); the widest is I */
    int d16 = o->compute == QT_BF16 || (o->compute == QT_F16 && (desc_of(o)->native_dtypes & QT_BE_DT(QT_F16)));
    s.dout16 = d16 && !o->grad_checkpointing ? carve16(base, &off, N * maxin) : NULL;
    if (g) *g = s;
    return off;
}

/* Full fine-tuning keeps the (N, V) logits from the forward for the lm_head's
 * backward (one (N, V, C) product and one exp pass fewer per step) when they
 * take no more bytes than the trainable state: master, gradients and Adam's
 * m and v, 16 bytes a parameter. Qwen2.5-0.5B at B*T = 256: 156 MB against
 * 7.9 GB; beyond about 13K tokens a micro-batch recomputes instead. */
int qt_model_keeps_logits(const qt_config *c, const qt_model_opts *o) {
    /* gradient windows: the lm_head's backward runs in vocabulary slices, which recompute their logits */
    if (o->infer || o->lora || o->grad_windows) return 0;
    size_t numel;
    qt_model_param_table(c, o, NULL, &numel);
    return qt_be_lmhead_ce_kept_floats(desc_of(o), (int)max_n(o), c->vocab_size) * 4 <= numel * 16;
}

size_t qt_model_kept_logits_offset(const qt_config *c, const qt_model_opts *o) {
    return (qt_be_lmhead_ce_ws_floats(desc_of(o), (int)max_n(o), c->hidden_size) + 15) / 16 * 16;
}

size_t qt_model_workspace_floats(const qt_config *c, const qt_model_opts *o) {
    const qt_backend_desc *d = desc_of(o);
    size_t ws = qt_be_lmhead_ce_ws_floats(d, (int)max_n(o), c->hidden_size);
    if (qt_model_keeps_logits(c, o))
        ws = qt_model_kept_logits_offset(c, o) + qt_be_lmhead_ce_kept_floats(d, (int)max_n(o), c->vocab_size);
    for (int j = 0; j < LIN_COUNT; j++) {
        int in, ou;
        qt_lin_shape(c, j, &in, &ou);
        size_t w = qt_be_matmul_ws_floats(d, in, ou);
        if (w > ws) ws = w;
    }
    size_t w = qt_be_matmul_ws_floats(d, c->hidden_size, c->vocab_size); /* decode logits */
    return w > ws ? w : ws;
}

size_t qt_model_carve_kv(const qt_config *c, const qt_model_opts *o, float *base, float **k, float **v) {
    if (!o->infer) return 0;
    const size_t seqs = o->decode_seqs > 1 ? (size_t)o->decode_seqs : 1;
    const size_t half = (size_t)c->num_hidden_layers * seqs * (size_t)o->max_T * (size_t)c->num_key_value_heads *
                        c->head_dim;
    size_t off = 0;
    float *pk = carve(base, &off, half), *pv = carve(base, &off, half);
    if (k) *k = pk;
    if (v) *v = pv;
    return off;
}

size_t qt_model_kv_floats(const qt_config *c, const qt_model_opts *o) { return qt_model_carve_kv(c, o, NULL, NULL, NULL); }

size_t qt_model_carve_ids(const qt_model_opts *o, float *base, qt_batch_ids *p) {
    size_t off = 0, n = max_n(o);
    qt_batch_ids s;
    s.inputs = (int32_t *)carve(base, &off, n); /* int32 in float slots */
    s.targets = (int32_t *)carve(base, &off, n);
    s.positions = (int32_t *)carve(base, &off, n);
    s.doc_start = (int32_t *)carve(base, &off, n);
    if (p) *p = s;
    return off;
}

int qt_model_opts_sharded(const qt_model_opts *o) {
    return o->master_shards > 1 && !o->lora && !o->infer && (o->compute != QT_F32 || o->param_shards > 1);
}

int qt_model_opts_base_sharded(const qt_model_opts *o) { return o->lora && !o->infer && o->param_shards > 1; }

size_t qt_model_base_block(const qt_config *c, const qt_model_opts *o, size_t *layer, size_t *outer) {
    const size_t VC = (size_t)c->vocab_size * (size_t)c->hidden_size;
    const unsigned sv = o->lora ? o->lora_save : 0;
    const int tied = c->tie_word_embeddings;
    /* qwen2_load.c load_vocab_mats' rule: a tied base matrix is read while either role still reads it */
    const int emb = !(sv & QT_SAVE_EMBED) || (tied && !(sv & QT_SAVE_LM_HEAD));
    const int lm = !tied && !(sv & QT_SAVE_LM_HEAD);
    size_t per = 0;
    for (int j = 0; j < LIN_COUNT; j++) {
        if (!qt_lin_owns(c, j)) continue;
        int in, out;
        qt_lin_shape(c, j, &in, &out);
        if (j == LIN_Q && !qt_lin_owns(c, LIN_K)) out = qt_lin_fused_rows(c); /* the original Qwen's c_attn */
        per += (size_t)in * (size_t)out;
    }
    if (layer) *layer = per;
    if (outer) *outer = emb || lm ? VC : 0;
    return (emb ? VC : 0) + (lm ? VC : 0) + per * (size_t)c->num_hidden_layers;
}

qt_dtype qt_model_base_block_dtype(const qt_config *c, const qt_model_opts *o) {
    if (o->compute != QT_F32) return o->compute;
    return c->torch_dtype == QT_F16 || c->torch_dtype == QT_BF16 ? c->torch_dtype : QT_F32;
}

void qt_model_gather_sizes(const qt_config *c, const qt_model_opts *o, size_t *layer, size_t *outer) {
    if (qt_model_opts_base_sharded(o)) {
        qt_model_base_block(c, o, layer, outer);
        return;
    }
    *layer = 0;
    *outer = (size_t)c->vocab_size * (size_t)c->hidden_size;
    int n = qt_model_param_table(c, o, NULL, NULL), L = c->num_hidden_layers;
    qt_param *t = qt_calloc((size_t)n + 1, sizeof *t, "model: parameter table");
    if (!t) return;
    qt_model_param_table(c, o, t, NULL);
    for (int l = 0; l < L; l++) {
        size_t lo = (size_t)-1, hi = 0;
        for (int i = 0; i < n; i++)
            if (t[i].layer == l) {
                if (t[i].offset < lo) lo = t[i].offset;
                if (t[i].offset + t[i].numel > hi) hi = t[i].offset + t[i].numel;
            }
        if (hi > lo && hi - lo > *layer) *layer = hi - lo;
    }
    qt_free(t);
}

/* Elements of the table's tensors of one kind: TABLE_LAYERS those inside the
 * decoder layers, TABLE_1D the 1-D ones (norm weights, biases). */
enum { TABLE_LAYERS, TABLE_1D };
static size_t table_numel(const qt_config *c, const qt_model_opts *o, int kind) {
    int n = qt_model_param_table(c, o, NULL, NULL);
    qt_param *t = qt_calloc((size_t)n + 1, sizeof *t, "model: parameter table");
    if (!t) return 0;
    qt_model_param_table(c, o, t, NULL);
    size_t k = 0;
    for (int i = 0; i < n; i++) k += (kind == TABLE_LAYERS ? t[i].layer >= 0 : t[i].ndim == 1) ? t[i].numel : 0;
    qt_free(t);
    return k;
}
static size_t layer_numel(const qt_config *c, const qt_model_opts *o) { return table_numel(c, o, TABLE_LAYERS); }

int qt_model_outer_mode(const qt_config *c, const qt_model_opts *o, size_t *between) {
    qt_model_opts full = *o;
    full.lora = 0;
    /* the layers' tensors (full fine-tuning's table holds every one; LoRA adds its adapter) and the final norm */
    size_t b = layer_numel(c, &full) + (size_t)c->hidden_size + (o->lora ? layer_numel(c, o) : 0);
    if (between) *between = b;
    const double d = o->param_reuse_distance;
    if (o->param_shards < 2 || o->infer || d > (double)b) return QT_OUTER_KEPT;
    return d > 0 ? QT_OUTER_FREED : QT_OUTER_SLICED;
}

/* Elements of the trainable 1-D tensors (norm weights, biases). */
static size_t one_d_numel(const qt_config *c, const qt_model_opts *o) { return table_numel(c, o, TABLE_1D); }

/* The layer linears a 4-bit base quantizes (qwen2_load.c lin_quantized):
 * their weights (into *numel) and the bytes of their 4-bit blocks. */
static size_t quant4_bytes(const qt_config *c, const qt_model_opts *o, size_t *numel) {
    size_t bytes = 0;
    *numel = 0;
    if (!o->quant4) return 0;
    for (int j = 0; j < LIN_COUNT; j++) {
        if (!qt_lin_owns(c, j) || (o->quant4_skip & qt_lin_flag[j])) continue;
        int in, out;
        qt_lin_shape(c, j, &in, &out);
        if (j == LIN_Q && !qt_lin_owns(c, LIN_K)) out = qt_lin_fused_rows(c); /* the original Qwen's c_attn */
        *numel += (size_t)in * (size_t)out * (size_t)c->num_hidden_layers;
        bytes += qt_q4_bytes((uint64_t)out, (uint64_t)in, QT_Q4_BLOCK, o->quant4_nested) *
                 (size_t)c->num_hidden_layers;
    }
    return bytes;
}

size_t qt_model_memory(const qt_config *c, const qt_model_opts *o, qt_mem_breakdown *out) {
    qt_mem_breakdown b;
    memset(&b, 0, sizeof b);
    size_t numel;
    qt_model_param_table(c, o, NULL, &numel);
    b.master = numel * 4;
    b.grads = o->infer ? 0 : numel * 4;
    if (!o->infer && o->grad_windows) {
        qt_grad_windows w;
        qt_model_grad_windows(c, o, &w);
        b.grads = w.total * 4;
    }
    int frozen = o->lora || o->infer;
    if (frozen) {
        qt_model_opts full = *o;
        full.lora = 0;
        size_t all;
        qt_model_param_table(c, &full, NULL, &all);
        /* norm weights and biases: 2 per layer + the final norm, plus q/k/v biases */
        size_t small = (size_t)c->hidden_size * (2 * (size_t)c->num_hidden_layers + 1);
        if (c->attention_bias)
            small += (size_t)c->num_hidden_layers * (size_t)(c->num_attention_heads + 2 * c->num_key_value_heads) *
                     c->head_dim;
        if (c->qk_norm) small += (size_t)c->num_hidden_layers * 2 * (size_t)c->head_dim;
        /* modules_to_save: a (V, C) matrix the graph reads from the trained copy, not the base (a tied
         * base matrix stays in use while either of its two roles still reads it) */
        size_t unused = 0, VC = (size_t)c->vocab_size * (size_t)c->hidden_size;
        unsigned sv = o->lora ? o->lora_save : 0;
        if (c->tie_word_embeddings) unused = sv == (QT_SAVE_EMBED | QT_SAVE_LM_HEAD) ? VC : 0;
        else unused = ((sv & QT_SAVE_EMBED) ? VC : 0) + ((sv & QT_SAVE_LM_HEAD) ? VC : 0);
        size_t qn;
        b.quant4 = quant4_bytes(c, o, &qn);
        b.base = (all - small - unused - qn) * qt_dtype_size(c->torch_dtype);
        /* training in f16/bf16 holds the base in the compute dtype: a copy when the file's differs */
        if (o->lora && !o->infer && o->compute != QT_F32 && c->torch_dtype != o->compute)
            b.compute_copy = (all - small - unused - qn) * qt_dtype_size(o->compute);
        b.base_f32 = small * 4;
        if (!o->lora) b.master = 0;
        if (qt_model_opts_base_sharded(o)) {
            /* LoRA at ZeRO-3: nothing stays in the mapping; this rank's shard of the base matrices (on the
             * host with offload_param) and the three gather buffers, in the base block's dtype */
            size_t layer, outer, lo, hi, es = qt_dtype_size(qt_model_base_block_dtype(c, o));
            size_t nb = qt_model_base_block(c, o, &layer, &outer);
            qt_shard_range(nb, o->param_shards, o->master_rank, &lo, &hi);
            b.base = 0;
            b.compute_copy = o->param_on_host ? 0 : (hi - lo) * es;
            b.compute_host = o->param_on_host ? (hi - lo) * es : 0;
            b.param_gather = (2 * layer + outer) * es;
            b.outer_gather = outer * es;
            b.outer_mode = qt_model_outer_mode(c, o, NULL);
        }
    }
    if (!frozen && o->compute != QT_F32) b.compute_copy = numel * qt_dtype_size(o->compute);
    if (qt_model_opts_sharded(o)) {
        /* this rank's shard of the master; the graph reads the compute copy and an f32 copy of the 1-D tensors */
        size_t lo, hi;
        qt_shard_range(numel, o->master_shards, o->master_rank, &lo, &hi);
        b.master = o->master_on_host ? 0 : (hi - lo) * 4;
        b.master_host = o->master_on_host ? (hi - lo) * 4 : 0;
        b.base_f32 = one_d_numel(c, o) * 4;
        if (o->param_shards > 1) {
            /* ZeRO-3: the compute weights are this rank's shard (in f32 the master itself) and three gather
             * buffers: two layers and the embedding / lm_head */
            size_t es = qt_dtype_size(o->compute), layer, outer;
            b.compute_copy = o->compute == QT_F32 || o->param_on_host ? 0 : (hi - lo) * es;
            b.compute_host = o->compute != QT_F32 && o->param_on_host ? (hi - lo) * es : 0;
            qt_model_gather_sizes(c, o, &layer, &outer);
            b.param_gather = (2 * layer + outer) * es;
            b.outer_gather = outer * es;
            b.outer_mode = qt_model_outer_mode(c, o, NULL);
            if (b.outer_mode == QT_OUTER_SLICED && qt_opts_trains_lm_head(c, o)) {
                /* the lm_head's backward reads one slice at a time while the V x C buffer is freed */
                qt_grad_windows w;
                qt_model_grad_windows(c, o, &w);
                b.head_slice = w.slice * es;
                b.param_gather = 2 * layer * es + (b.head_slice > b.outer_gather ? b.head_slice : b.outer_gather);
            }
        }
    }
    b.activations = qt_model_carve_acts(c, o, NULL, NULL) * 4;
    b.act_grads = qt_model_carve_grads(c, o, NULL, NULL) * 4;
    b.workspace = qt_model_workspace_floats(c, o) * 4;
    b.kv_cache = qt_model_kv_floats(c, o) * 4;
    b.total = b.master + b.grads + b.base_f32 + b.activations + b.act_grads + b.workspace + b.kv_cache +
              b.compute_copy + b.quant4 + b.param_gather;
    if (out) *out = b;
    return b.total;
}
