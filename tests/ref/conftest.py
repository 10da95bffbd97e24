"""Shared helpers for the reference-parity tests: random model folders written
with st.py, batches with packed rows, and a runner for qtune_ref_driver."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402

BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
DRIVER = os.path.join(BUILD, "tests", "unit", "model", "qtune_ref_driver")
QTUNE = os.environ.get("QTUNE_BIN", os.path.join(BUILD, "src", "cli", "qtune"))

# name: (arch, H, KV, D, C, I, L, V, tied, file dtype)
SHAPES = {
    "qwen2-gqa1-d64-tied-f32": ("qwen2", 2, 2, 64, 128, 160, 2, 320, True, "F32"),
    "qwen2-gqa2-d64-untied-bf16": ("qwen2", 4, 2, 64, 256, 192, 2, 288, False, "BF16"),
    "qwen2-gqa7-d128-tied-f32": ("qwen2", 7, 1, 128, 896, 256, 1, 200, True, "F32"),
    "llama-gqa2-d64-untied-bf16": ("llama", 4, 2, 64, 256, 192, 2, 288, False, "BF16"),
    # Qwen3: head_dim on its own, so q is H*D = 192 / 512 wide against hidden 128 / 256
    "qwen3-gqa2-d48-tied-f32": ("qwen3", 4, 2, 48, 128, 160, 2, 320, True, "F32"),
    "qwen3-gqa4-d64-untied-bf16": ("qwen3", 8, 2, 64, 256, 192, 2, 288, False, "BF16"),
    # the original Qwen (QWenLMHeadModel): fused c_attn, no GQA, D = C / H, I = the MLP width
    "qwen1-d32-untied-f32": ("qwen", 4, 4, 32, 128, 160, 2, 320, False, "F32"),
    "qwen1-d64-untied-bf16": ("qwen", 4, 4, 64, 256, 192, 2, 288, False, "BF16"),
}

ARCH = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def make_qwen1_model(path, H, D, C, I, L, V, dtype, seed):
    """A QWenLMHeadModel folder: QWenConfig's keys (intermediate_size is twice the MLP width) and its
    tensor names, c_attn fused (q, k, v rows) with a bias."""
    assert H * D == C
    cfg = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "hidden_size": C,
           "intermediate_size": 2 * I, "num_attention_heads": H, "kv_channels": D, "num_hidden_layers": L,
           "vocab_size": V, "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0,
           "seq_length": 2048, "max_position_embeddings": 8192, "no_bias": True, "use_dynamic_ntk": True,
           "use_logn_attn": True, "scale_attn_weights": True, "tie_word_embeddings": False,
           "bf16": dtype == "BF16", "fp16": False, "fp32": dtype != "BF16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    rng = np.random.default_rng(seed)
    w = {"transformer.wte.weight": rng.normal(0, 2.0 / np.sqrt(C), (V, C)),
         "transformer.ln_f.weight": 1 + 0.1 * rng.normal(size=C),
         "lm_head.weight": rng.normal(0, 1.0 / np.sqrt(C), (V, C))}
    for l in range(L):
        pre = "transformer.h.%d." % l
        w[pre + "ln_1.weight"] = 1 + 0.1 * rng.normal(size=C)
        w[pre + "ln_2.weight"] = 1 + 0.1 * rng.normal(size=C)
        w[pre + "attn.c_attn.weight"] = rng.normal(0, 1.0 / np.sqrt(C), (3 * C, C))
        w[pre + "attn.c_attn.bias"] = 0.1 * rng.normal(size=3 * C)
        w[pre + "attn.c_proj.weight"] = rng.normal(0, 1.0 / np.sqrt(C), (C, C))
        w[pre + "mlp.w1.weight"] = rng.normal(0, 1.0 / np.sqrt(C), (I, C))
        w[pre + "mlp.w2.weight"] = rng.normal(0, 1.0 / np.sqrt(C), (I, C))
        w[pre + "mlp.c_proj.weight"] = rng.normal(0, 1.0 / np.sqrt(I), (C, I))
    st.write(os.path.join(path, "model.safetensors"), {k: v.astype(np.float32) for k, v in w.items()}, dtype)
    cfg["num_key_value_heads"] = H  # for the callers' shape arithmetic, not in the file
    return cfg


def make_model(path, shape, seed=0):
    arch, H, KV, D, C, I, L, V, tied, dtype = SHAPES[shape] if isinstance(shape, str) else shape
    os.makedirs(path, exist_ok=True)
    if arch == "qwen":
        return make_qwen1_model(path, H, D, C, I, L, V, dtype, seed)
    cfg = {
        "architectures": [ARCH[arch]],
        "model_type": arch, "hidden_size": C, "intermediate_size": I, "num_attention_heads": H,
        "num_key_value_heads": KV, "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if arch == "qwen2" else 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": tied, "hidden_act": "silu",
        "torch_dtype": "bfloat16" if dtype == "BF16" else "float32",
    }
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if arch != "qwen2":
        cfg["attention_bias"] = False
    if arch == "qwen3":
        cfg["head_dim"] = D
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(0, 2.0 / np.sqrt(C), (V, C)), "model.norm.weight": 1 + 0.1 * rng.normal(size=C)}
    if not tied:
        w["lm_head.weight"] = rng.normal(0, 1.0 / np.sqrt(C), (V, C))
    shapes = {"self_attn.q_proj": (H * D, C), "self_attn.k_proj": (KV * D, C), "self_attn.v_proj": (KV * D, C),
              "self_attn.o_proj": (C, H * D), "mlp.gate_proj": (I, C), "mlp.up_proj": (I, C),
              "mlp.down_proj": (C, I)}
    for l in range(L):
        pre = "model.layers.%d." % l
        w[pre + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=C)
        w[pre + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=C)
        if arch == "qwen3":
            w[pre + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.normal(size=D)
            w[pre + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.normal(size=D)
        for name, (o, i) in shapes.items():
            w[pre + name + ".weight"] = rng.normal(0, 1.0 / np.sqrt(i), (o, i))
            if arch == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                w[pre + name + ".bias"] = 0.1 * rng.normal(size=o)
    st.write(os.path.join(path, "model.safetensors"), {k: v.astype(np.float32) for k, v in w.items()}, dtype)
    return cfg


def make_batch(V, B=2, T=24, seed=1, packed=True):
    """Row 0: one example; the other rows packed with several examples
    (positions restart, doc_start marks each example's first index)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, V, (B, T))
    targets = np.full((B, T), -100)
    pos = np.tile(np.arange(T), (B, 1))
    doc = np.zeros((B, T), dtype=np.int64)
    for b in range(B):
        starts = [0] if (b == 0 or not packed) else [0, T // 3, T // 3 + T // 4]
        for k, s in enumerate(starts):
            e = starts[k + 1] if k + 1 < len(starts) else T
            pos[b, s:e] = np.arange(e - s)
            doc[b, s:e] = s
            targets[b, s:e - 1] = inputs[b, s + 1:e]  # next token inside the example
        targets[b, rng.integers(0, T, 2)] = -100      # a few unlabelled positions
    return {"B": B, "T": T, "inputs": inputs.ravel().tolist(), "targets": targets.ravel().tolist(),
            "positions": pos.ravel().tolist(), "doc_start": doc.ravel().tolist()}


def as_arrays(batch):
    B, T = batch["B"], batch["T"]
    return {k: np.array(batch[k]).reshape(B, T) for k in ("inputs", "targets", "positions", "doc_start")}


def run_driver(tmp, model_dir, batch, *opts, tag="out", env=None):
    """env: variables to set for the driver's run (e.g. QTUNE_BF16_GEMM=off)"""
    bp = os.path.join(tmp, tag + "-batch.json")
    with open(bp, "w") as f:
        json.dump(batch, f)
    out = os.path.join(tmp, tag + ".safetensors")
    r = subprocess.run([DRIVER, model_dir, bp, out, *opts], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 0, r.stderr
    return st.read(out)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.fixture(scope="session", autouse=True)
def _need_driver():
    if not os.path.exists(DRIVER):
        pytest.fail("qtune_ref_driver is not built at %s; build the project (cmake --build) first" % DRIVER)
