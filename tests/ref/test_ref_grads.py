"""Gradient parity against the PyTorch reference (torch autograd in float64):
every gradient of full fine-tuning and of LoRA (PEFT semantics) within a
relative error (||g - g_ref|| / ||g_ref|| per tensor) of 1e-4; recomputation
on/off gives identical gradients; gradients accumulate; adapters round-trip."""
import json
import os

import numpy as np
import pytest
import torch

import st
from conftest import SHAPES, as_arrays, make_batch, make_model, rel_err, run_driver
from qwen1_ref import reference
from qwen2_ref import LINEARS

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ref_backward(ref, batch, scale=1.0):
    a = as_arrays(batch)
    loss, n, _ = ref.loss(a["inputs"], a["targets"], a["positions"], a["doc_start"])
    (loss * scale).backward()
    return loss.item()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_full_ft_gradients(tmp_path, shape):
    md = str(tmp_path / "model")
    cfg = make_model(md, shape)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--grad-scale", "0.25")
    ref = reference(md)
    loss = ref_backward(ref, batch, 0.25)
    assert abs(out["loss_sum"][0] - loss) <= 1e-5 * abs(loss)
    names = {k[5:] for k in out if k.startswith("grad/")}
    assert names == set(ref.p), "trainable tensors differ from the file's: %s" % (names ^ set(ref.p))
    worst = max((rel_err(out["grad/" + k], ref.p[k].grad.numpy()), k) for k in names)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])


QWEN1_MODULES = ["attn.c_attn", "attn.c_proj", "mlp.w1", "mlp.w2", "mlp.c_proj"]


def adapted_modules(cfg, targets):
    """(layer path, module path, in, out) for each module PEFT's target_modules select, by its suffix
    rule: an entry matches a module whose name is it or ends with "." + it."""
    C, H, KV, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    if cfg["model_type"] == "qwen":
        I //= 2  # QWenConfig's intermediate_size is twice the MLP width
        D = cfg["kv_channels"]
        dims = {"attn.c_attn": (C, 3 * H * D), "attn.c_proj": (H * D, C), "mlp.w1": (C, I), "mlp.w2": (C, I),
                "mlp.c_proj": (I, C)}
        layers, mods = "transformer.h", QWEN1_MODULES
    else:
        D = cfg.get("head_dim") or C // H
        dims = dict(zip(LINEARS, [(C, H * D), (C, KV * D), (C, KV * D), (H * D, C), (C, I), (C, I), (I, C)]))
        layers, mods = "model.layers", LINEARS
    return [(layers, m) + dims[m] for m in mods if any(m == t or m.endswith("." + t) for t in targets)]


def write_adapter(path, cfg, r, alpha, targets, rslora=False, seed=3):
    """A PEFT adapter folder with random A and (non-zero) B."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for layers, mod, i, o in adapted_modules(cfg, targets):
            key = "base_model.model.%s.%d.%s" % (layers, l, mod)
            w[key + ".lora_A.weight"] = rng.uniform(-1, 1, (r, i)) / np.sqrt(i)
            w[key + ".lora_B.weight"] = rng.normal(0, 0.2, (o, r))
    st.write(os.path.join(path, "adapter_model.safetensors"), w, "F32")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
                   "target_modules": targets, "use_rslora": rslora, "bias": "none", "fan_in_fan_out": False,
                   "base_model_name_or_path": "test"}, f)
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize("shape,targets,rslora", [
    ("qwen2-gqa2-d64-untied-bf16", ALL, False),
    ("qwen2-gqa7-d128-tied-f32", ["q_proj", "v_proj"], True),
    ("llama-gqa2-d64-untied-bf16", ["k_proj", "o_proj", "down_proj"], False),
    ("qwen3-gqa4-d64-untied-bf16", ALL, False),
    ("qwen3-gqa2-d48-tied-f32", ["q_proj", "k_proj", "o_proj"], True),
    # the original Qwen: c_attn one module (one A, one B over q, k, v), c_proj = attn.c_proj + mlp.c_proj
    ("qwen1-d64-untied-bf16", ["c_attn", "c_proj", "w1", "w2"], False),
    ("qwen1-d32-untied-f32", ["c_attn", "mlp.c_proj"], True),
])
def test_lora_gradients(tmp_path, shape, targets, rslora):
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, shape)
    w = write_adapter(ad, cfg, 4, 8.0, targets, rslora)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--adapter", ad)
    ref = reference(md, lora={"r": 4, "alpha": 8.0, "rslora": rslora, "weights": w})
    loss = ref_backward(ref, batch)
    assert abs(out["loss_sum"][0] - loss) <= 1e-5 * abs(loss)
    names = {k[5:] for k in out if k.startswith("grad/")}
    assert names == set(w)
    worst = max((rel_err(out["grad/" + k], ref.lp[k].grad.numpy()), k) for k in names)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])


@pytest.mark.parametrize("mode,shape", [("full", "qwen2-gqa2-d64-untied-bf16"),
                                        ("lora-dropout", "qwen2-gqa2-d64-untied-bf16"),
                                        ("full", "qwen3-gqa4-d64-untied-bf16")])
def test_recompute_gives_identical_gradients(tmp_path, mode, shape):
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, shape)
    batch = make_batch(cfg["vocab_size"])
    extra = []
    if mode != "full":
        write_adapter(ad, cfg, 4, 8.0, ALL)
        extra = ["--adapter", ad, "--dropout", "0.3"]
    a = run_driver(str(tmp_path), md, batch, "--mode", "train", *extra, tag="a")
    b = run_driver(str(tmp_path), md, batch, "--mode", "train", "--recompute", *extra, tag="b")
    keys = [k for k in a if k.startswith("grad/")]
    assert keys
    for k in keys:
        assert np.array_equal(a[k], b[k]), k
    if mode != "full":
        c = run_driver(str(tmp_path), md, batch, "--mode", "train", "--adapter", ad, tag="c")
        assert any(not np.allclose(a[k], c[k]) for k in keys), "dropout changed nothing"


def test_gradients_accumulate(tmp_path):
    md = str(tmp_path / "model")
    cfg = make_model(md, "qwen2-gqa1-d64-tied-f32")
    batch = make_batch(cfg["vocab_size"])
    one = run_driver(str(tmp_path), md, batch, "--mode", "train", tag="one")
    two = run_driver(str(tmp_path), md, batch, "--mode", "train", "--steps", "2", "--grad-scale", "0.5", tag="two")
    for k in one:
        if k.startswith("grad/"):
            assert rel_err(two[k], one[k]) <= 1e-6, k


def test_lora_init_and_adapter_round_trip(tmp_path):
    md = str(tmp_path / "model")
    cfg = make_model(md, "qwen2-gqa2-d64-untied-bf16")
    batch = make_batch(cfg["vocab_size"])
    saved = str(tmp_path / "saved")
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--lora", "8", "16", "q_proj,v_proj",
                     "--save-adapter", saved)
    w = st.read(os.path.join(saved, "adapter_model.safetensors"))
    assert len(w) == 2 * 2 * cfg["num_hidden_layers"]
    for k, v in w.items():
        if ".lora_A." in k:
            bound = 1 / np.sqrt(v.shape[1])
            assert v.shape[0] == 8 and np.abs(v).max() <= bound and np.abs(v).max() > 0.9 * bound
            assert np.all(out["grad/" + k] == 0)  # B = 0: no gradient reaches A yet
        else:
            assert v.shape[1] == 8 and np.all(v == 0)
            assert np.abs(out["grad/" + k]).max() > 0
    c = json.load(open(os.path.join(saved, "adapter_config.json")))
    assert c["r"] == 8 and c["lora_alpha"] == 16 and sorted(c["target_modules"]) == ["q_proj", "v_proj"]
    # load a random adapter, save it again: the same tensors come back
    ad, again = str(tmp_path / "adapter"), str(tmp_path / "again")
    orig = write_adapter(ad, cfg, 4, 8.0, ALL)
    run_driver(str(tmp_path), md, batch, "--mode", "eval", "--adapter", ad, "--save-adapter", again, tag="rt")
    back = st.read(os.path.join(again, "adapter_model.safetensors"))
    assert set(back) == set(orig)
    for k in orig:
        assert np.array_equal(back[k], orig[k]), k


def test_adapter_eval_matches_reference(tmp_path):
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, "qwen2-gqa7-d128-tied-f32")
    w = write_adapter(ad, cfg, 4, 8.0, ["q_proj", "v_proj", "down_proj"], rslora=True)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "eval", "--adapter", ad)
    ref = reference(md, lora={"r": 4, "alpha": 8.0, "rslora": True, "weights": w})
    a = as_arrays(batch)
    with torch.no_grad():
        loss, n, lp = ref.loss(a["inputs"], a["targets"], a["positions"], a["doc_start"])
    assert abs(out["loss_sum"][0] - loss.item()) <= 1e-5 * abs(loss.item())


@pytest.mark.parametrize("shape,targets", [("qwen2-gqa2-d64-untied-bf16", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
                                           ("qwen1-d32-untied-f32", ["c_attn", "c_proj", "w2"])])
def test_lora_dropout_gradients(tmp_path, shape, targets):
    """With lora_dropout, the gradients equal the reference's with the same
    masks (dumped by the driver): dropout acts on the LoRA branch's input only,
    once per adapted module (the original Qwen's c_attn: one mask for q, k, v)."""
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, shape)
    w = write_adapter(ad, cfg, 4, 8.0, targets)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--adapter", ad, "--dropout", "0.25",
                     "--dump-masks")
    masks = {(int(k[5:].split(".")[0]), k[5:].split(".", 1)[1]): v for k, v in out.items() if k.startswith("mask/")}
    assert len(masks) == len(adapted_modules(cfg, targets)) * cfg["num_hidden_layers"]
    for m in masks.values():
        assert set(np.unique(m)) <= {0.0, np.float32(1 / 0.75)}
        assert 0.15 < np.mean(m == 0) < 0.35
    ref = reference(md, lora={"r": 4, "alpha": 8.0, "weights": w, "masks": masks})
    loss = ref_backward(ref, batch)
    assert abs(out["loss_sum"][0] - loss) <= 1e-5 * abs(loss)
    worst = max((rel_err(out["grad/" + k], ref.lp[k].grad.numpy()), k) for k in w)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])
