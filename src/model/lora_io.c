/* PEFT adapter folders <-> the model's LoRA block. */
#include "model/lora_io.h"

#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "core/messages.h"
#include "core/mem.h"
#include "io/peft.h"
#include "model/model_internal.h"
#include "model/params_io.h"

/* "model.layers.{i}.self_attn.q_proj" ... in the model's layout ("transformer.h.{i}.attn.c_attn" ...) */
static void lin_module(char *out, size_t cap, const qt_config *c, int layer, int j) {
    snprintf(out, cap, "%s.%d.%s", qt_config_layout(c)->layers, layer, qt_lin_name(c, j));
}

/* The original Qwen's names for what a Qwen2-style list asked for: the sentence's "write ..." part. */
static void qwen1_names_for(const peft_config *pc, char *out, size_t cap) {
    static const struct { const char *qwen2, *qwen1; } map[] = {
        {"q_proj", "c_attn"}, {"k_proj", "c_attn"}, {"v_proj", "c_attn"}, {"o_proj", "c_proj"},
        {"gate_proj", "w2"}, {"up_proj", "w1"}, {"down_proj", "c_proj"},
    };
    const char *picked[8];
    int n = 0;
    for (size_t k = 0; k < sizeof map / sizeof map[0]; k++) {
        int want = 0, dup = 0;
        for (int e = 0; e < pc->n_targets; e++) want |= !strcmp(pc->target_modules[e], map[k].qwen2);
        for (int i = 0; i < n; i++) dup |= !strcmp(picked[i], map[k].qwen1);
        if (want && !dup) picked[n++] = map[k].qwen1;
    }
    if (!n) picked[n++] = "c_attn"; /* PEFT's own default for model_type qwen */
    size_t o = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < n && o < cap; i++) o += (size_t)snprintf(out + o, cap - o, "%s\"%s\"", i ? ", " : "", picked[i]);
    if (o < cap) snprintf(out + o, cap - o, "]");
}

static int is_qwen2_name(const char *s) {
    for (int j = 0; j < LIN_COUNT; j++)
        if (!strcmp(s, qt_lin_short[j])) return 1;
    return 0;
}

/* layers_to_transform: whether PEFT adapts module (in layer l) given its
 * target_modules already match. -1 with an error when layers_pattern finds
 * a layer number other than l's (a pattern that reads another part of the
 * name). */
static int layer_selected(const peft_config *pc, const char *module, int l, const char *where) {
    if (!pc->n_layers) return 1;
    int idx = peft_layer_index(pc, module);
    if (idx < 0) return 0;
    if (idx != l)
        return QT_ERR(QT_EUNSUPPORTED, "%s: layers_pattern reads layer %d from %s, which is layer %d; name the "
                      "model's layer list", where, idx, module, l), -1;
    return peft_layer_listed(pc, l);
}

/* A module path's last name: "layers" of "model.layers", "h" of "transformer.h", "wte" of "transformer.wte". */
static const char *leaf(const char *path) {
    const char *dot = strrchr(path, '.');
    return dot ? dot + 1 : path;
}

/* layers_to_transform's checks against the model: every listed index is one
 * of its layers (PEFT passes over one that is not; qtune says so), and
 * layers_pattern finds the layer number in its module names. */
static int check_layers(const qt_config *c, const peft_config *pc, const char *where) {
    const qt_layout *ly = qt_config_layout(c);
    const int L = c->num_hidden_layers;
    if (!pc->n_layers) return QT_OK;
    if (L > QT_LORA_MAX_LAYERS)
        return QT_ERR(QT_EUNSUPPORTED, "%s: layers_to_transform on a model of %d layers; qtune handles it for up to %d",
                      where, L, QT_LORA_MAX_LAYERS);
    char name[160];
    snprintf(name, sizeof name, "%s.0.%s", ly->layers, qt_lin_name(c, LIN_Q));
    if (pc->n_patterns && peft_layer_index(pc, name) < 0)
        return QT_ERR(QT_EUNSUPPORTED, "%s: layers_pattern '%s' does not match this %s model, whose layers are %s.N; "
                      "write \"%s\"", where, pc->layers_pattern[0], qt_arch_name(c->arch), ly->layers,
                      leaf(ly->layers));
    for (int i = 0; i < pc->n_layers; i++)
        if (pc->layers_to_transform[i] >= L)
            return QT_ERR(QT_EINVAL, "%s: layers_to_transform lists layer %d, but the model has %d layers (0 to %d)",
                          where, pc->layers_to_transform[i], L, L - 1);
    return QT_OK;
}

/* modules_to_save against the model's layout: the embedding (embed_tokens;
 * the original Qwen's wte) and lm_head, by PEFT's name rule (the module's
 * name or a dotted suffix of it); anything else is refused by name. */
static int saved_modules(const qt_config *c, const peft_config *pc, unsigned *save, const char *where) {
    const qt_layout *ly = qt_config_layout(c);
    *save = 0;
    for (int i = 0; i < pc->n_save; i++) {
        const char *e = pc->modules_to_save[i];
        if (peft_target_entry_matches(e, ly->embed) && strcmp(e, "all-linear")) *save |= QT_SAVE_EMBED;
        else if (peft_target_entry_matches(e, "lm_head") && strcmp(e, "all-linear")) *save |= QT_SAVE_LM_HEAD;
        else
            return QT_ERR(QT_EUNSUPPORTED, "%s: modules_to_save names '%s'; qtune trains the embedding (%s) and "
                          "lm_head beside an adapter, nothing else; list only those", where, e, leaf(ly->embed));
    }
    return QT_OK;
}

int qt_lora_targets_for(const qt_config *c, const peft_config *pc, unsigned *mask, const char *where) {
    qt_model_opts o;
    memset(&o, 0, sizeof o);
    QT_TRY(qt_lora_resolve(c, pc, &o, where));
    *mask = o.lora_targets;
    return QT_OK;
}

int qt_lora_resolve(const qt_config *c, const peft_config *pc, qt_model_opts *o, const char *where) {
    char tm[PEFT_MAX_REGEX + 64], name[128];
    const qt_layout *ly = qt_config_layout(c);
    const int n_layers = c->num_hidden_layers;
    peft_targets_str(pc, tm, sizeof tm);
    unsigned *mask = &o->lora_targets;
    *mask = 0;
    QT_TRY(saved_modules(c, pc, &o->lora_save, where));
    QT_TRY(check_layers(c, pc, where));
    /* Qwen2 names on an original Qwen model: PEFT stops with "Target modules {...} not found in the base
     * model"; say why and what to write, before anything is loaded */
    if (ly->fused_qkv && !pc->target_regex[0]) {
        char bad[PEFT_MAX_REGEX + 64] = "", list[160];
        size_t o = 0;
        for (int e = 0; e < pc->n_targets && o < sizeof bad; e++)
            if (is_qwen2_name(pc->target_modules[e]))
                o += (size_t)snprintf(bad + o, sizeof bad - o, "%s%s", o ? ", " : "", pc->target_modules[e]);
        if (bad[0]) {
            qwen1_names_for(pc, list, sizeof list);
            return QT_ERR(QT_EUNSUPPORTED, QT_MSG_QWEN1_TARGETS_FMT, where, bad, list);
        }
    }
    /* the layers layers_to_transform keeps (all without it); in each, PEFT's own choice of modules */
    int n_sel = 0;
    memset(o->lora_layers, 0, sizeof o->lora_layers);
    for (int i = 0; i < n_layers; i++) {
        lin_module(name, sizeof name, c, i, LIN_Q);
        int on = layer_selected(pc, name, i, where);
        if (on < 0) return qt_error_code();
        if (on && i < QT_LORA_MAX_LAYERS) o->lora_layers[i / 64] |= (uint64_t)1 << (i % 64);
        n_sel += on;
    }
    o->lora_layers_set = pc->n_layers > 0 && n_sel < n_layers;
    for (int j = 0; j < LIN_COUNT; j++) {
        int hit = 0;
        for (int i = 0; i < n_layers; i++) {
            lin_module(name, sizeof name, c, i, j);
            hit += peft_targets_module(pc, name) && (!pc->n_layers || qt_lora_layer_on(o, i));
        }
        if (hit == n_sel && n_sel > 0)
            *mask |= qt_lin_flag[j];
        else if (hit && pc->n_layers)
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s: target_modules (%s) selects %s in %d of the %d layers layers_to_transform keeps; qtune "
                          "adapts the same modules in every adapted layer",
                          where, tm, qt_lin_name(c, j), hit, n_sel);
        else if (hit)
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s: target_modules (%s) selects %s in %d of the model's %d layers; qtune adapts the same "
                          "modules in every layer",
                          where, tm, qt_lin_name(c, j), hit, n_layers);
    }
    /* PEFT would adapt these too; qtune has no LoRA for them, so refuse rather than drop them */
    const char *const other[] = {"lm_head", ly->embed};
    int all_linear = !pc->target_regex[0] && pc->n_targets == 1 && !strcmp(pc->target_modules[0], "all-linear");
    for (size_t k = 0; k < sizeof other / sizeof other[0] && !all_linear; k++)
        if (peft_targets_module(pc, other[k]))
            return QT_ERR(QT_EUNSUPPORTED, "%s: target_modules (%s) selects %s, which qtune does not adapt", where, tm,
                          other[k]);
    /* a list entry that names no module: PEFT refuses such a config ("not found in the base model") */
    for (int e = 0; e < pc->n_targets; e++) {
        int found = 0;
        for (int j = 0; j < LIN_COUNT && !found; j++) {
            lin_module(name, sizeof name, c, 0, j);
            found = peft_target_entry_matches(pc->target_modules[e], name);
        }
        if (!found && ly->fused_qkv)
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s: target_modules entry '%s' names none of the original Qwen's c_attn, c_proj, w1, w2",
                          where, pc->target_modules[e]);
        if (!found)
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s: target_modules entry '%s' names none of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                          "up_proj, down_proj",
                          where, pc->target_modules[e]);
    }
    if (!*mask)
        return QT_ERR(QT_EFORMAT, "%s: target_modules (%s) selects none of the model's linear layers", where, tm);
    return QT_OK;
}

int qt_lora_targets_from_peft(const peft_config *pc, int n_layers, unsigned *mask, const char *where) {
    qt_config c;
    memset(&c, 0, sizeof c);
    c.arch = QT_ARCH_QWEN2;
    c.num_hidden_layers = n_layers;
    return qt_lora_targets_for(&c, pc, mask, where);
}

int qt_lora_targets_from_names(const qt_config *c, const char *const *names, int n, unsigned *mask,
                               const char *where) {
    peft_config pc;
    memset(&pc, 0, sizeof pc);
    if (n < 1 || n > PEFT_MAX_TARGETS)
        return QT_ERR(QT_EINVAL, "%s: lora.target_modules must list 1 to %d names", where, PEFT_MAX_TARGETS);
    for (int i = 0; i < n; i++) {
        if (strlen(names[i]) >= sizeof pc.target_modules[0])
            return QT_ERR(QT_EINVAL, "%s: lora.target_modules entry '%.40s...' is too long", where, names[i]);
        snprintf(pc.target_modules[pc.n_targets++], sizeof pc.target_modules[0], "%s", names[i]);
    }
    return qt_lora_targets_for(c, &pc, mask, where);
}

int qt_lora_target_names(const qt_config *c, unsigned mask, char names[][64], int cap) {
    int n = 0;
    if (qt_config_layout(c)->fused_qkv) {
        /* PEFT's module names: c_attn (q, k, v together), c_proj (both, or the one asked for), w1, w2 */
        unsigned o = mask & QT_LORA_O, d = mask & QT_LORA_DOWN;
        if ((mask & (QT_LORA_Q | QT_LORA_K | QT_LORA_V)) && n < cap) snprintf(names[n++], 64, "c_attn");
        if (o && d && n < cap) snprintf(names[n++], 64, "c_proj");
        else if (o && n < cap) snprintf(names[n++], 64, "attn.c_proj");
        else if (d && n < cap) snprintf(names[n++], 64, "mlp.c_proj");
        if ((mask & QT_LORA_UP) && n < cap) snprintf(names[n++], 64, "w1");
        if ((mask & QT_LORA_GATE) && n < cap) snprintf(names[n++], 64, "w2");
        return n;
    }
    for (int j = 0; j < LIN_COUNT; j++)
        if ((mask & qt_lin_flag[j]) && n < cap) snprintf(names[n++], 64, "%s", qt_lin_short[j]);
    return n;
}

int qt_lora_opts_from_adapter(const char *dir, const qt_config *cfg, qt_model_opts *o) {
    peft_config pc;
    QT_TRY(peft_config_load(dir, &pc));
    char where[4200];
    snprintf(where, sizeof where, "%s/adapter_config.json", dir);
    o->lora = 1;
    o->lora_r = pc.r;
    o->lora_alpha = pc.lora_alpha;
    o->lora_dropout = pc.lora_dropout;
    o->use_rslora = pc.use_rslora;
    return qt_lora_resolve(cfg, &pc, o, where); /* targets, modules_to_save, layers_to_transform */
}

int qt_lora_load(qt_model *m, const char *dir) {
    if (!m->opts.lora) return QT_ERR(QT_EINVAL, "loading adapter %s: the model was loaded without LoRA", dir);
    st_file *st;
    QT_TRY(peft_open_weights(dir, &st));
    int rc = QT_OK;
    for (int i = 0; i < m->n_params && rc == QT_OK; i++) {
        const qt_param *p = &m->params[i];
        const st_tensor *t = st_find(st, p->name);
        if (!t) {
            /* PEFT also accepts the adapter-named form X.lora_A.default.weight */
            char alt[200];
            size_t n = strlen(p->name);
            snprintf(alt, sizeof alt, "%.*s.default.weight", (int)(n - 7), p->name);
            t = st_find(st, alt);
        }
        if (!t) {
            rc = QT_ERR(QT_EFORMAT, "%s/adapter_model.safetensors has no tensor %s; the adapter does not match "
                                    "adapter_config.json or this model",
                        dir, p->name);
            break;
        }
        if (t->ndim != 2 || t->shape[0] != p->shape[0] || t->shape[1] != p->shape[1]) {
            rc = QT_ERR(QT_EFORMAT, "%s/adapter_model.safetensors: %s has shape [%lld, %lld], this model needs "
                                    "[%lld, %lld]; was the adapter trained on another model?",
                        dir, t->name, (long long)t->shape[0], (long long)(t->ndim > 1 ? t->shape[1] : 0),
                        (long long)p->shape[0], (long long)p->shape[1]);
            break;
        }
        rc = qt_model_read_param(m, i, t);
    }
    if (rc == QT_OK && st_count(st) > m->n_params) {
        /* a tensor for a module or layer this model does not adapt would be silently lost */
        for (int i = 0; i < st_count(st); i++) {
            const char *name = st_at(st, i)->name;
            char base[200];
            int is_b;
            if (!peft_base_name(name, base, sizeof base, &is_b)) {
                rc = QT_ERR(QT_EUNSUPPORTED, "%s/adapter_model.safetensors holds %s, which is neither a LoRA A/B "
                                             "weight nor a module adapter_config.json's modules_to_save lists",
                            dir, name);
                break;
            }
        }
        if (rc == QT_OK)
            rc = QT_ERR(QT_EFORMAT, "%s/adapter_model.safetensors holds %d tensors but the model expects %d; check "
                                    "target_modules in adapter_config.json",
                        dir, st_count(st), m->n_params);
    }
    st_close(st);
    return rc;
}

void qt_lora_peft_extras(const qt_config *c, const qt_model_opts *o, peft_config *pc) {
    const qt_layout *ly = qt_config_layout(c);
    pc->n_save = 0;
    if (o->lora_save & QT_SAVE_EMBED) snprintf(pc->modules_to_save[pc->n_save++], 64, "%s", leaf(ly->embed));
    if (o->lora_save & QT_SAVE_LM_HEAD) snprintf(pc->modules_to_save[pc->n_save++], 64, "lm_head");
    pc->n_layers = pc->layers_int = pc->n_patterns = pc->patterns_list = 0;
    if (!o->lora_layers_set) return;
    for (int l = 0; l < c->num_hidden_layers && pc->n_layers < PEFT_MAX_LAYERS; l++)
        if (qt_lora_layer_on(o, l)) pc->layers_to_transform[pc->n_layers++] = l;
    snprintf(pc->layers_pattern[pc->n_patterns++], 64, "%s", leaf(ly->layers));
}

int qt_lora_save(const qt_model *m, const char *dir, const char *base_model) {
    if (!m->opts.lora) return QT_ERR(QT_EINVAL, "saving an adapter to %s: the model has no LoRA block", dir);
    peft_config pc;
    memset(&pc, 0, sizeof pc);
    pc.r = m->opts.lora_r;
    pc.lora_alpha = m->opts.lora_alpha;
    pc.lora_dropout = m->opts.lora_dropout;
    pc.use_rslora = m->opts.use_rslora;
    char names[LIN_COUNT][64];
    int n = qt_lora_target_names(&m->cfg, m->opts.lora_targets, names, LIN_COUNT);
    for (int j = 0; j < n; j++) memcpy(pc.target_modules[pc.n_targets++], names[j], sizeof pc.target_modules[0]);
    snprintf(pc.base_model, sizeof pc.base_model, "%s", base_model ? base_model : "");
    qt_lora_peft_extras(&m->cfg, &m->opts, &pc);
    peft_tensor *t = qt_calloc((size_t)m->n_params, sizeof *t, "adapter tensor list");
    if (!t) return QT_ENOMEM;
    qt_model_peft_tensors(m, t);
    int rc = peft_save(dir, &pc, t, m->n_params);
    qt_free(t);
    return rc;
}
