/* Presets: published model shapes (from each model's config.json on the
 * Hugging Face Hub, base models, not -Instruct) and small shapes for tests and
 * demos. Names are matched without regard to case.
 *
 * Qwen2.5 base configs differ from their -Instruct siblings in
 * max_position_embeddings (131072 vs 32768 for 1.5B/7B/14B/32B/72B) and, for
 * 14B/32B/72B, rms_norm_eps (1e-5 vs 1e-6); the base values are used here. */
#include "io/hf_config.h"
#include "core/error.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

typedef struct {
    const char *name;
    const char *summary;
    qt_arch arch;
    int V, C, I, L, H, KV;
    int D; /* head_dim; 0: C / H */
    int tie;
    float rope_theta, eps;
    int max_pos;
    int bos, eos;
    qt_dtype dtype;
} qt_preset_row;

#define QWEN_BOS 151643 /* <|endoftext|> */
#define QWEN_IM_END 151645

static const qt_preset_row presets[] = {
    /* name            summary
     *                 arch           V       C     I      L   H   KV  tie rope_theta eps   max_pos  bos       eos */
    {"qwen2.5-0.5b", "Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 kv, tied embeddings",
     QT_ARCH_QWEN2, 151936, 896, 4864, 24, 14, 2, 0, 1, 1e6f, 1e-6f, 32768, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-1.5b", "Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads / 2 kv, tied embeddings",
     QT_ARCH_QWEN2, 151936, 1536, 8960, 28, 12, 2, 0, 1, 1e6f, 1e-6f, 131072, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-3b", "Qwen2.5-3B: 36 layers, hidden 2048, 16 heads / 2 kv, tied embeddings",
     QT_ARCH_QWEN2, 151936, 2048, 11008, 36, 16, 2, 0, 1, 1e6f, 1e-6f, 32768, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-7b", "Qwen2.5-7B: 28 layers, hidden 3584, 28 heads / 4 kv",
     QT_ARCH_QWEN2, 152064, 3584, 18944, 28, 28, 4, 0, 0, 1e6f, 1e-6f, 131072, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-14b", "Qwen2.5-14B: 48 layers, hidden 5120, 40 heads / 8 kv",
     QT_ARCH_QWEN2, 152064, 5120, 13824, 48, 40, 8, 0, 0, 1e6f, 1e-5f, 131072, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-32b", "Qwen2.5-32B: 64 layers, hidden 5120, 40 heads / 8 kv",
     QT_ARCH_QWEN2, 152064, 5120, 27648, 64, 40, 8, 0, 0, 1e6f, 1e-5f, 131072, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen2.5-72b", "Qwen2.5-72B: 80 layers, hidden 8192, 64 heads / 8 kv",
     QT_ARCH_QWEN2, 152064, 8192, 29568, 80, 64, 8, 0, 0, 1e6f, 1e-5f, 131072, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen1.5-14b", "Qwen1.5-14B: 40 layers, hidden 5120, 40 heads (no GQA), MLP 13696",
     QT_ARCH_QWEN2, 152064, 5120, 13696, 40, 40, 40, 0, 0, 1e6f, 1e-6f, 32768, QWEN_BOS, QWEN_BOS, QT_BF16},
    {"qwen-14b-qwen2-layout", "Qwen-14B's shape in the Qwen2 layout (separate q/k/v, model.layers names): 40 "
                              "layers, hidden 5120, 40 heads, MLP 13696, RoPE base 10000",
     QT_ARCH_QWEN2, 152064, 5120, 13696, 40, 40, 40, 0, 0, 1e4f, 1e-6f, 8192, QWEN_BOS, QWEN_BOS, QT_BF16},
    /* The original Qwen (QWenLMHeadModel, model_type qwen): fused attn.c_attn, mlp.w1/w2/c_proj; I here is
     * the MLP width (config.json's intermediate_size is twice it). Dynamic NTK and logn attention are on
     * in these configs, so sequences stop at seq_length (the max_pos column). */
    {"qwen-1.8b", "Qwen-1.8B (original QWenLMHeadModel): 24 layers, hidden 2048, 16 heads, MLP 5504, seq 8192",
     QT_ARCH_QWEN, 151936, 2048, 5504, 24, 16, 16, 0, 0, 1e4f, 1e-6f, 8192, -1, QWEN_BOS, QT_BF16},
    {"qwen-7b", "Qwen-7B (original QWenLMHeadModel): 32 layers, hidden 4096, 32 heads, MLP 11008, seq 8192",
     QT_ARCH_QWEN, 151936, 4096, 11008, 32, 32, 32, 0, 0, 1e4f, 1e-6f, 8192, -1, QWEN_BOS, QT_BF16},
    {"qwen-14b", "Qwen-14B (original QWenLMHeadModel): 40 layers, hidden 5120, 40 heads, MLP 13696, seq 2048",
     QT_ARCH_QWEN, 152064, 5120, 13696, 40, 40, 40, 0, 0, 1e4f, 1e-6f, 2048, -1, QWEN_BOS, QT_BF16},
    {"qwen-72b", "Qwen-72B (original QWenLMHeadModel): 80 layers, hidden 8192, 64 heads, MLP 24576, seq 32768",
     QT_ARCH_QWEN, 152064, 8192, 24576, 80, 64, 64, 0, 0, 1e6f, 1e-6f, 32768, -1, QWEN_BOS, QT_BF16},
    /* Qwen3 dense (Qwen3ForCausalLM: q_norm/k_norm, head_dim 128 given on its own, no q/k/v bias), the
     * released (post-trained) repositories Qwen/Qwen3-*: max_position_embeddings 40960, eos <|im_end|> */
    {"qwen3-0.6b", "Qwen3-0.6B: 28 layers, hidden 1024, 16 heads / 8 kv of 128, MLP 3072, tied",
     QT_ARCH_QWEN3, 151936, 1024, 3072, 28, 16, 8, 128, 1, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    {"qwen3-1.7b", "Qwen3-1.7B: 28 layers, hidden 2048, 16 heads / 8 kv of 128, MLP 6144, tied",
     QT_ARCH_QWEN3, 151936, 2048, 6144, 28, 16, 8, 128, 1, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    {"qwen3-4b", "Qwen3-4B: 36 layers, hidden 2560, 32 heads / 8 kv of 128, MLP 9728, tied",
     QT_ARCH_QWEN3, 151936, 2560, 9728, 36, 32, 8, 128, 1, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    {"qwen3-8b", "Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 kv of 128, MLP 12288",
     QT_ARCH_QWEN3, 151936, 4096, 12288, 36, 32, 8, 128, 0, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    {"qwen3-14b", "Qwen3-14B: 40 layers, hidden 5120, 40 heads / 8 kv of 128, MLP 17408",
     QT_ARCH_QWEN3, 151936, 5120, 17408, 40, 40, 8, 128, 0, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    {"qwen3-32b", "Qwen3-32B: 64 layers, hidden 5120, 64 heads / 8 kv of 128 (q is 8192 wide), MLP 25600",
     QT_ARCH_QWEN3, 151936, 5120, 25600, 64, 64, 8, 128, 0, 1e6f, 1e-6f, 40960, QWEN_BOS, QWEN_IM_END, QT_BF16},
    /* Small shapes for tests and demos (not published models). */
    {"tiny", "test shape: vocab 512, 2 layers, hidden 64, 4 heads / 2 kv, MLP 176, tied",
     QT_ARCH_QWEN2, 512, 64, 176, 2, 4, 2, 0, 1, 1e6f, 1e-6f, 2048, -1, -1, QT_F32},
    {"tiny-llama", "test shape, Llama layout (no q/k/v bias, untied lm_head): vocab 512, 2 layers, hidden 64, 4 heads / 2 kv",
     QT_ARCH_LLAMA, 512, 64, 176, 2, 4, 2, 0, 0, 1e4f, 1e-6f, 2048, -1, -1, QT_F32},
    {"demo", "demo shape on the real Qwen vocabulary (151936): 2 layers, hidden 128, 4 heads / 2 kv, tied; trains in minutes on a CPU",
     QT_ARCH_QWEN2, 151936, 128, 352, 2, 4, 2, 0, 1, 1e6f, 1e-6f, 32768, QWEN_BOS, QWEN_IM_END, QT_F32},
    {"tiny-qwen3", "test shape, Qwen3 layout (q_norm/k_norm, head_dim 32 given on its own so q is 128 wide, no "
                   "q/k/v bias): vocab 512, 2 layers, hidden 64, 4 heads / 2 kv, MLP 176, tied",
     QT_ARCH_QWEN3, 512, 64, 176, 2, 4, 2, 32, 1, 1e6f, 1e-6f, 2048, -1, -1, QT_F32},
    {"tiny-qwen", "test shape, original Qwen layout (fused c_attn, w1/w2/c_proj, untied): vocab 512, 2 layers, "
                  "hidden 64, 4 heads, MLP 176",
     QT_ARCH_QWEN, 512, 64, 176, 2, 4, 4, 0, 0, 1e4f, 1e-6f, 2048, -1, -1, QT_F32},
    {"bench-tiny", "benchmark shape on the real Qwen vocabulary: 4 layers, hidden 256, 4 heads / 2 kv, MLP 704, tied",
     QT_ARCH_QWEN2, 151936, 256, 704, 4, 4, 2, 0, 1, 1e6f, 1e-6f, 32768, QWEN_BOS, QWEN_IM_END, QT_F32},
};
#define NPRESETS ((int)(sizeof presets / sizeof presets[0]))

int qt_preset_count(void) { return NPRESETS; }
const char *qt_preset_name(int i) { return (i >= 0 && i < NPRESETS) ? presets[i].name : NULL; }
const char *qt_preset_summary(int i) { return (i >= 0 && i < NPRESETS) ? presets[i].summary : NULL; }

int qt_preset(const char *name, qt_config *cfg) {
    for (int i = 0; i < NPRESETS; i++) {
        const qt_preset_row *p = &presets[i];
        if (strcasecmp(name, p->name)) continue;
        memset(cfg, 0, sizeof *cfg);
        cfg->arch = p->arch;
        cfg->vocab_size = p->V;
        cfg->hidden_size = p->C;
        cfg->intermediate_size = p->I;
        cfg->num_hidden_layers = p->L;
        cfg->num_attention_heads = p->H;
        cfg->num_key_value_heads = p->KV;
        cfg->head_dim = p->D ? p->D : p->C / p->H;
        cfg->rms_norm_eps = p->eps;
        cfg->rope_theta = p->rope_theta;
        cfg->max_position_embeddings = p->max_pos;
        cfg->tie_word_embeddings = p->tie;
        cfg->attention_bias = p->arch == QT_ARCH_QWEN2 || p->arch == QT_ARCH_QWEN;
        cfg->qk_norm = p->arch == QT_ARCH_QWEN3;
        if (p->arch == QT_ARCH_QWEN) { /* published configs: max_position_embeddings >= seq_length, NTK/logn on */
            cfg->seq_length = p->max_pos;
            cfg->max_position_embeddings = p->max_pos < 8192 ? 8192 : p->max_pos;
            cfg->long_context = 1;
        }
        cfg->torch_dtype = p->dtype;
        cfg->initializer_range = 0.02f; /* transformers' default */
        cfg->bos_token_id = p->bos;
        cfg->eos_token_id = p->eos;
        return QT_OK;
    }
    char list[1024];
    size_t k = 0;
    list[0] = 0;
    for (int i = 0; i < NPRESETS && k < sizeof list; i++)
        k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", i ? ", " : "", presets[i].name);
    return QT_ERR(QT_EINVAL, "unknown preset '%.64s'; the presets are: %s", name, list);
}
