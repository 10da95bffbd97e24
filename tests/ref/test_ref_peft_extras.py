"""PEFT's modules_to_save and layers_to_transform against the PyTorch
reference (qwen2_ref / qwen1_ref in float64, PEFT's semantics):
  - modules_to_save: the embedding and/or lm_head are trained copies; their
    gradients (every element) and LoRA's within the LoRA tests' 1e-4 relative
    error per tensor; on a tied model a listed module is its own copy and the
    other role keeps the frozen base weight (PEFT's ModulesToSaveWrapper);
  - layers_to_transform: LoRA only in the listed layers (no tensors, no
    gradients for the others), the layer read with layers_pattern;
  - an adapter with both round-trips through the driver's load and save with
    PEFT's keys, and its adapter_config.json lists them."""
import json
import os

import numpy as np
import pytest
import torch

import st
from conftest import SHAPES, as_arrays, make_batch, make_model, rel_err, run_driver
from qwen1_ref import reference
from test_ref_grads import adapted_modules

EMBED = {"qwen": "transformer.wte", "qwen2": "model.embed_tokens", "qwen3": "model.embed_tokens",
         "llama": "model.embed_tokens"}


def write_adapter(path, cfg, r, alpha, targets, save=(), layers=None, pattern=None, seed=7, extra=None):
    """A PEFT adapter folder: random A and non-zero B on the layers of `layers` (all when None), and for
    each of `save` ("embed", "lm_head") a trained copy (the base weight plus noise) under PEFT's key."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = st.read(os.path.join(os.path.dirname(path), "model", "model.safetensors"))
    emb = EMBED[cfg["model_type"]]
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        if layers is not None and l not in layers:
            continue
        for lay, mod, i, o in adapted_modules(cfg, targets):
            key = "base_model.model.%s.%d.%s" % (lay, l, mod)
            w[key + ".lora_A.weight"] = rng.uniform(-1, 1, (r, i)) / np.sqrt(i)
            w[key + ".lora_B.weight"] = rng.normal(0, 0.2, (o, r))
    names = []
    for s in save:
        src = emb + ".weight" if s == "embed" or cfg.get("tie_word_embeddings") else "lm_head.weight"
        key = "base_model.model." + (emb + ".weight" if s == "embed" else "lm_head.weight")
        w[key] = base[src].astype(np.float64) + rng.normal(0, 0.05, base[src].shape)
        names.append(emb.split(".")[-1] if s == "embed" else "lm_head")
    st.write(os.path.join(path, "adapter_model.safetensors"), w, "F32")
    c = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
         "target_modules": targets, "bias": "none", "modules_to_save": names or None,
         "layers_to_transform": layers, "layers_pattern": pattern, "base_model_name_or_path": "test"}
    c.update(extra or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(c, f)
    return {k: v.astype(np.float32) for k, v in w.items()}


def grads_match(tmp_path, shape, targets, save=(), layers=None, pattern=None):
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, shape)
    w = write_adapter(ad, cfg, 4, 8.0, targets, save, layers, pattern)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--adapter", ad, "--grad-scale", "0.5")
    ref = reference(md, lora={"r": 4, "alpha": 8.0, "weights": w})
    a = as_arrays(batch)
    loss, n, _ = ref.loss(a["inputs"], a["targets"], a["positions"], a["doc_start"])
    (loss * 0.5).backward()
    assert abs(out["loss_sum"][0] - loss.item()) <= 1e-5 * abs(loss.item())
    names = {k[5:] for k in out if k.startswith("grad/")}
    assert names == set(w), names ^ set(w)
    worst = max((rel_err(out["grad/" + k], ref.lp[k].grad.numpy()), k) for k in names)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])
    return cfg, w, out


@pytest.mark.parametrize("shape,targets,save", [
    ("qwen2-gqa2-d64-untied-bf16", ["q_proj", "v_proj"], ("embed", "lm_head")),
    ("llama-gqa2-d64-untied-bf16", ["k_proj", "down_proj"], ("lm_head",)),
    ("qwen3-gqa4-d64-untied-bf16", ["q_proj", "o_proj"], ("embed",)),
    # tied: each listed role its own copy, the other the frozen base embedding
    ("qwen2-gqa1-d64-tied-f32", ["q_proj", "v_proj"], ("embed",)),
    ("qwen3-gqa2-d48-tied-f32", ["q_proj", "v_proj"], ("lm_head",)),
    ("qwen2-gqa1-d64-tied-f32", ["v_proj"], ("embed", "lm_head")),
    ("qwen1-d32-untied-f32", ["c_attn"], ("embed", "lm_head")),
])
def test_modules_to_save_gradients(tmp_path, shape, targets, save):
    cfg, w, out = grads_match(tmp_path, shape, targets, save)
    # every row of a saved embedding that a token used has a gradient, the others none
    if "embed" in save:
        key = "base_model.model.%s.weight" % EMBED[cfg["model_type"]]
        used = np.unique(as_arrays(make_batch(cfg["vocab_size"]))["inputs"])
        rows = np.flatnonzero(np.abs(out["grad/" + key]).sum(1))
        assert rows.size and set(rows) <= set(used.tolist())


@pytest.mark.parametrize("shape,targets,layers,pattern", [
    ("qwen2-gqa2-d64-untied-bf16", ["q_proj", "v_proj", "down_proj"], [1], "layers"),
    ("qwen3-gqa4-d64-untied-bf16", ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "v_proj"],
     [0], None),
    ("qwen1-d64-untied-bf16", ["c_attn", "c_proj"], [1], "h"),
])
def test_layers_to_transform_gradients(tmp_path, shape, targets, layers, pattern):
    cfg, w, out = grads_match(tmp_path, shape, targets, layers=layers, pattern=pattern)
    for k in out:
        if k.startswith("grad/"):
            assert ".%d." % layers[0] in k  # no LoRA tensor for the other layer


def test_both_and_round_trip(tmp_path):
    """modules_to_save and layers_to_transform together; the adapter saved again by qtune holds the same
    tensors under PEFT's keys and its config lists them."""
    cfg, w, out = grads_match(tmp_path, "qwen2-gqa2-d64-untied-bf16", ["q_proj", "v_proj"], ("embed", "lm_head"),
                              layers=[0], pattern="layers")
    md, ad, again = str(tmp_path / "model"), str(tmp_path / "adapter"), str(tmp_path / "again")
    run_driver(str(tmp_path), md, make_batch(cfg["vocab_size"]), "--mode", "eval", "--adapter", ad,
               "--save-adapter", again, tag="rt")
    back = st.read(os.path.join(again, "adapter_model.safetensors"))
    assert set(back) == set(w)
    assert "base_model.model.model.embed_tokens.weight" in back and "base_model.model.lm_head.weight" in back
    for k in w:
        assert np.array_equal(back[k], w[k]), k
    c = json.load(open(os.path.join(again, "adapter_config.json")))
    assert c["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert c["layers_to_transform"] == [0] and c["layers_pattern"] == "layers"


def driver_fails(tmp_path, shape, targets, **kw):
    md, ad = str(tmp_path / "model"), str(tmp_path / "adapter")
    cfg = make_model(md, shape)
    write_adapter(ad, cfg, 4, 8.0, targets, **kw)
    import subprocess
    from conftest import DRIVER
    bp = str(tmp_path / "b.json")
    json.dump(make_batch(cfg["vocab_size"]), open(bp, "w"))
    r = subprocess.run([DRIVER, md, bp, str(tmp_path / "o.safetensors"), "--mode", "eval", "--adapter", ad],
                       capture_output=True, text=True)
    assert r.returncode != 0
    return r.stderr


def test_refusals(tmp_path):
    # a layers_pattern that is not this architecture's layer list, named with the one to write
    e = driver_fails(tmp_path / "a", "qwen2-gqa2-d64-untied-bf16", ["q_proj"], layers=[1], pattern="h")
    assert "layers_pattern 'h' does not match" in e and "model.layers" in e and '"layers"' in e, e
    e = driver_fails(tmp_path / "b", "qwen1-d32-untied-f32", ["c_attn"], layers=[0], pattern="layers")
    assert "layers_pattern 'layers'" in e and '"h"' in e, e
    # a layer the model does not have
    e = driver_fails(tmp_path / "c", "qwen2-gqa2-d64-untied-bf16", ["q_proj"], layers=[5])
    assert "layers_to_transform lists layer 5" in e, e
    # modules_to_save other than the embedding and lm_head
    e = driver_fails(tmp_path / "d", "qwen2-gqa2-d64-untied-bf16", ["q_proj"],
                     extra={"modules_to_save": ["q_proj"]})
    assert "modules_to_save names 'q_proj'" in e, e
    # PEFT's own rules: layers_pattern needs layers_to_transform; ensure_weight_tying is not implemented
    e = driver_fails(tmp_path / "e", "qwen2-gqa2-d64-untied-bf16", ["q_proj"], extra={"layers_pattern": "layers"})
    assert "layers_pattern is set but layers_to_transform is not" in e, e
    e = driver_fails(tmp_path / "f", "qwen2-gqa1-d64-tied-f32", ["q_proj"], save=("embed",),
                     extra={"ensure_weight_tying": True})
    assert "ensure_weight_tying" in e, e
