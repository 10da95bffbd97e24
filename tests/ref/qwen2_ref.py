"""A small, readable PyTorch Qwen2ForCausalLM (and Llama, and Qwen3ForCausalLM)
with Hugging Face semantics, plus LoRA as PEFT computes it. Reads the same model folders as
qtune (config.json + model.safetensors via st.py). Used only by the tests.

Semantics followed (transformers' modeling_qwen2):
  - RMSNorm in fp32: w * x * rsqrt(mean(x^2) + eps)
  - RoPE rotate-half; inv_freq = 1 / theta^(arange(0, D, 2) / D) and the angles
    pos * inv_freq computed in fp32
  - attention softmax(q k^T / sqrt(D)) with a causal mask, GQA by repeating kv
    heads; packed rows: query t sees keys [doc_start[t], t]
  - MLP down(silu(gate(x)) * up(x)); q/k/v bias for Qwen2
  - lm_head tied to embed_tokens when tie_word_embeddings
  - Qwen3 (transformers' modeling_qwen3, Qwen3Attention): q_norm / k_norm, a
    Qwen3RMSNorm(head_dim, eps=rms_norm_eps) over each head of
    q_proj(x).view(..., heads, head_dim) and k_proj(x) likewise, applied
    before RoPE; head_dim read on its own (H * D may differ from hidden); no
    q/k/v bias unless attention_bias
  - LoRA: y = W x + b + scaling * B(A(dropout(x))), scaling = alpha / r
    (alpha / sqrt(r) with use_rslora); only the modules whose lora_A/lora_B
    the weights hold (layers_to_transform: the other layers have none)
  - PEFT's modules_to_save: a weights key base_model.model.<embedding>.weight
    or base_model.model.lm_head.weight is a trained copy that replaces that
    module; with tied embeddings the other role keeps the frozen base weight
    (PEFT's ModulesToSaveWrapper copies one module, which unties them)."""
import json
import math
import os

import numpy as np
import torch

import st

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


class Qwen2Ref:
    def __init__(self, model_dir, dtype=torch.float64, lora=None, bf16_inputs=False):
        """lora: None, or {"r", "alpha", "rslora", "weights": {peft key: array},
        "masks": {(layer, "self_attn.q_proj"): dropout mask / (1 - p), (B*T, in)} (optional)}
        bf16_inputs: each layer Linear's input rounded to bf16 first (a torch bf16 model's
        matmul: bf16 inputs, products accumulated in fp32; what qtune's inference does on
        bf16 weights where the CPU has the bf16 GEMM)"""
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = cfg = json.load(f)
        self.dtype = dtype
        self.bf16_inputs = bf16_inputs
        self.C = cfg["hidden_size"]
        self.H = cfg["num_attention_heads"]
        self.KV = cfg.get("num_key_value_heads", self.H)
        self.D = cfg.get("head_dim") or self.C // self.H
        self.L = cfg["num_hidden_layers"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.theta = cfg.get("rope_theta", 10000.0)
        self.rope_scaling = cfg.get("rope_scaling")
        self.max_pos = cfg.get("max_position_embeddings", 2048)
        self.tied = cfg.get("tie_word_embeddings", False)
        self.qk_norm = cfg.get("model_type") == "qwen3"
        w = st.read(os.path.join(model_dir, "model.safetensors"))
        self.p = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in w.items()}
        if self.tied:
            self.p.pop("lm_head.weight", None)
        self.lora = None
        if lora is not None:
            self.lora = dict(lora)
            r = lora["r"]
            self.scaling = lora["alpha"] / (math.sqrt(r) if lora.get("rslora") else r)
            self.lp = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in lora["weights"].items()}

    # ---- pieces --------------------------------------------------------------
    def rmsnorm(self, x, w):
        x32 = x.to(torch.float32) if self.dtype == torch.float32 else x
        var = x32.pow(2).mean(-1, keepdim=True)
        return w * (x32 * torch.rsqrt(var + self.eps)).to(x.dtype)

    LAYERS = "model.layers"

    def linear(self, x, l, name):
        pre = "%s.%d.%s" % (self.LAYERS, l, name)
        if getattr(self, "bf16_inputs", False):
            x = x.to(torch.bfloat16).to(x.dtype)
        y = x @ self.p[pre + ".weight"].T
        if pre + ".bias" in self.p:
            y = y + self.p[pre + ".bias"]
        key = "base_model.model." + pre
        if self.lora is not None and key + ".lora_A.weight" in self.lp:
            a, b = self.lp[key + ".lora_A.weight"], self.lp[key + ".lora_B.weight"]
            masks = self.lora.get("masks")  # dropout(x) = x * mask / (1 - p), masks given as mask / (1 - p)
            xd = x * torch.as_tensor(masks[(l, name)], dtype=x.dtype).view(x.shape) if masks else x
            y = y + (xd @ a.T) @ b.T * self.scaling
        return y

    def inv_freq(self, seq_len):
        """(inv_freq, attention_factor) as transformers' modeling_rope_utils computes them for
        rope_scaling (default, linear, dynamic, yarn, llama3), in torch float32 as there."""
        D, base = self.D, self.theta
        rs = self.rope_scaling or {}
        kind = rs.get("rope_type", rs.get("type", "default"))

        def default(b):
            return 1.0 / (b ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))

        orig = rs.get("original_max_position_embeddings") or self.max_pos
        if kind == "default":
            return default(base), 1.0
        factor = rs.get("factor")
        if kind == "linear":
            return default(base) / factor, 1.0
        if kind == "dynamic":
            seq_len = seq_len if seq_len > orig else orig
            base = base * ((factor * seq_len / orig) - (factor - 1)) ** (D / (D - 2))
            return default(base), 1.0
        if kind == "llama3":
            inv = default(base)
            lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
            lo_wl, hi_wl = orig / lo, orig / hi
            wl = 2 * math.pi / inv
            inv_l = torch.where(wl > lo_wl, inv / factor, inv)
            smooth = (orig / wl - lo) / (hi - lo)
            smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
            medium = ~(wl < hi_wl) * ~(wl > lo_wl)
            return torch.where(medium, smoothed, inv_l), 1.0
        if kind == "yarn":
            if factor is None:
                factor = self.max_pos / orig

            def mscale(s, m=1):
                return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

            af = rs.get("attention_factor")
            if af is None:
                m, mad = rs.get("mscale"), rs.get("mscale_all_dim")
                af = mscale(factor, m) / mscale(factor, mad) if m and mad else mscale(factor)
            bf, bs = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

            def cdim(rot):
                return (D * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

            low, high = cdim(bf), cdim(bs)
            if rs.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, D - 1)
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
            pf = base ** (torch.arange(0, D, 2).float() / D)
            extra = 1 - ramp
            return (1.0 / (factor * pf)) * (1 - extra) + (1.0 / pf) * extra, af
        raise ValueError("rope type %s" % kind)

    def rope(self, x, pos):
        # x (B, T, heads, D); HF computes inv_freq and the angles in fp32
        D = self.D
        inv, af = self.inv_freq(int(pos.max()) + 1)
        ang = pos.float()[..., None] * inv  # (B, T, D/2) fp32
        ang = torch.cat([ang, ang], -1)
        cos = (torch.cos(ang.double()) * af).to(self.dtype)[:, :, None, :]
        sin = (torch.sin(ang.double()) * af).to(self.dtype)[:, :, None, :]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        rot = torch.cat([-x2, x1], -1)
        return x * cos + rot * sin

    def attention(self, q, k, v, doc_start):
        B, T = q.shape[:2]
        G = self.H // self.KV
        k = k.repeat_interleave(G, dim=2)
        v = v.repeat_interleave(G, dim=2)
        s = torch.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(self.D)
        t = torch.arange(T)
        j = torch.arange(T)
        allowed = (j[None, None, :] <= t[None, :, None]) & (j[None, None, :] >= doc_start[:, :, None])
        s = s.masked_fill(~allowed[:, None, :, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.einsum("bhtj,bjhd->bthd", p, v)

    # ---- the model -----------------------------------------------------------
    def logits(self, ids, pos=None, doc_start=None):
        ids = torch.as_tensor(ids, dtype=torch.long)
        B, T = ids.shape
        pos = torch.arange(T)[None, :].expand(B, T) if pos is None else torch.as_tensor(pos, dtype=torch.long)
        doc_start = torch.zeros(B, T, dtype=torch.long) if doc_start is None else torch.as_tensor(doc_start,
                                                                                                 dtype=torch.long)
        p = self.p
        x = self.vocab_matrix("model.embed_tokens.weight", "embed")[ids]
        for l in range(self.L):
            pre = "model.layers.%d." % l
            h = self.rmsnorm(x, p[pre + "input_layernorm.weight"])
            q = self.linear(h, l, LINEARS[0]).view(B, T, self.H, self.D)
            k = self.linear(h, l, LINEARS[1]).view(B, T, self.KV, self.D)
            if self.qk_norm:
                q = self.rmsnorm(q, p[pre + "self_attn.q_norm.weight"])
                k = self.rmsnorm(k, p[pre + "self_attn.k_norm.weight"])
            v = self.linear(h, l, LINEARS[2]).view(B, T, self.KV, self.D)
            q, k = self.rope(q, pos), self.rope(k, pos)
            a = self.attention(q, k, v, doc_start).reshape(B, T, self.H * self.D)
            x = x + self.linear(a, l, LINEARS[3])
            h = self.rmsnorm(x, p[pre + "post_attention_layernorm.weight"])
            g, u = self.linear(h, l, LINEARS[4]), self.linear(h, l, LINEARS[5])
            x = x + self.linear(torch.nn.functional.silu(g) * u, l, LINEARS[6])
        x = self.rmsnorm(x, p["model.norm.weight"])
        if getattr(self, "bf16_inputs", False):
            x = x.to(torch.bfloat16).to(x.dtype)
        return x @ self.vocab_matrix("model.embed_tokens.weight", "lm_head").T

    def vocab_matrix(self, embed, role):
        """The embedding (role "embed") or the lm_head weight: a modules_to_save copy when the LoRA weights
        hold one, else the base's (the embedding for a tied lm_head)."""
        key = "base_model.model." + (embed if role == "embed" else "lm_head.weight")
        if self.lora is not None and key in self.lp:
            return self.lp[key]
        return self.p[embed] if role == "embed" or self.tied else self.p["lm_head.weight"]

    def loss(self, ids, targets, pos=None, doc_start=None):
        """Sum of cross-entropy over targets != -100, their count, per-position
        log-prob of the target (0 where unlabelled)."""
        lg = self.logits(ids, pos, doc_start)
        t = torch.as_tensor(targets, dtype=torch.long)
        lp = torch.log_softmax(lg, -1)
        mask = t != -100
        tl = lp.gather(-1, t.clamp(min=0)[..., None])[..., 0] * mask
        return -tl.sum(), int(mask.sum()), tl.detach()

    def trainables(self):
        return self.lp if self.lora is not None else self.p
