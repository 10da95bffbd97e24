"""The original Qwen (QWenLMHeadModel, Qwen-7B/14B/72B) in PyTorch, written
from its published modeling_qwen.py, with LoRA as PEFT computes it on that
model (c_attn is one module: lora_A (r, C), lora_B (3C, r)). Reads the same
folders as qtune (QWenConfig's config.json + model.safetensors). Test-only.

What modeling_qwen.py does, step by step (QWenBlock / QWenAttention / QWenMLP):
  - ln_1 / ln_2 / ln_f: RMSNorm(hidden, eps=layer_norm_epsilon),
    x.float() * rsqrt(mean(x^2) + eps), cast back, times the weight
  - mixed = c_attn(x) (bias=True); query, key, value = mixed.split(C, dim=2)
  - rotary: RotaryEmbedding(kv_channels * rotary_pct, base=rotary_emb_base),
    inv_freq = 1 / base^(arange(0, dim, 2) / dim), emb = cat(freqs, freqs),
    t * cos + _rotate_half(t) * sin with _rotate_half(x) = cat(-x2, x1): the
    rotate-half convention. Dynamic NTK (alpha 1) and logn scaling (only for
    keys beyond seq_length) are the identity within seq_length
  - attention: softmax(q k^T / sqrt(head_dim)) with the causal mask
  - c_proj(attention output) (bias = not no_bias = False)
  - MLP: c_proj(w1(x) * silu(w2(x))): w2 passes through SiLU, each of w1/w2
    is intermediate_size // 2 wide; no biases
  - lm_head: its own weight (untied)."""
import json
import os

import torch

import st
from qwen2_ref import Qwen2Ref


class QwenRef(Qwen2Ref):
    LAYERS = "transformer.h"

    def __init__(self, model_dir, dtype=torch.float64, lora=None, bf16_inputs=False):
        self.bf16_inputs = bf16_inputs
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = cfg = json.load(f)
        assert cfg.get("rotary_pct", 1.0) == 1.0
        self.dtype = dtype
        self.C = cfg["hidden_size"]
        self.H = self.KV = cfg["num_attention_heads"]
        self.D = cfg["kv_channels"]
        self.L = cfg["num_hidden_layers"]
        self.eps = cfg.get("layer_norm_epsilon", 1e-6)
        self.theta = cfg.get("rotary_emb_base", 10000)
        self.rope_scaling = None  # its own dynamic NTK is not implemented (limited to seq_length)
        self.max_pos = cfg.get("max_position_embeddings", 2048)
        self.tied = cfg.get("tie_word_embeddings", False)
        self.qk_norm = False
        w = st.read(os.path.join(model_dir, "model.safetensors"))
        self.p = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in w.items()}
        self.lora = None
        if lora is not None:
            self.lora = dict(lora)
            r = lora["r"]
            self.scaling = lora["alpha"] / ((r ** 0.5) if lora.get("rslora") else r)
            self.lp = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in lora["weights"].items()}

    def logits(self, ids, pos=None, doc_start=None):
        ids = torch.as_tensor(ids, dtype=torch.long)
        B, T = ids.shape
        pos = torch.arange(T)[None, :].expand(B, T) if pos is None else torch.as_tensor(pos, dtype=torch.long)
        doc_start = torch.zeros(B, T, dtype=torch.long) if doc_start is None else torch.as_tensor(doc_start,
                                                                                                 dtype=torch.long)
        p, HD = self.p, self.H * self.D
        x = self.vocab_matrix("transformer.wte.weight", "embed")[ids]
        for l in range(self.L):
            pre = "transformer.h.%d." % l
            h = self.rmsnorm(x, p[pre + "ln_1.weight"])
            q, k, v = self.linear(h, l, "attn.c_attn").split(HD, dim=2)
            q = self.rope(q.reshape(B, T, self.H, self.D), pos)
            k = self.rope(k.reshape(B, T, self.H, self.D), pos)
            a = self.attention(q, k, v.reshape(B, T, self.H, self.D), doc_start).reshape(B, T, HD)
            x = x + self.linear(a, l, "attn.c_proj")
            h = self.rmsnorm(x, p[pre + "ln_2.weight"])
            a1, a2 = self.linear(h, l, "mlp.w1"), self.linear(h, l, "mlp.w2")
            x = x + self.linear(a1 * torch.nn.functional.silu(a2), l, "mlp.c_proj")
        x = self.rmsnorm(x, p["transformer.ln_f.weight"])
        if getattr(self, "bf16_inputs", False):
            x = x.to(torch.bfloat16).to(x.dtype)
        return x @ self.vocab_matrix("transformer.wte.weight", "lm_head").T


def reference(model_dir, **kw):
    """The reference for any folder: QwenRef for QWenLMHeadModel, else Qwen2Ref."""
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f).get("architectures", [""])[0]
    return (QwenRef if arch == "QWenLMHeadModel" else Qwen2Ref)(model_dir, **kw)
