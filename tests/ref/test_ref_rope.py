"""RoPE scaling (linear, dynamic, yarn, llama3) against the PyTorch reference
(qwen2_ref.Qwen2Ref.inv_freq follows transformers' modeling_rope_utils): the
forward (loss and per-token log-probs, rel err <= 1e-5), every gradient
(rel err <= 1e-4) and KV-cache decoding (rel err <= 1e-5), on a config whose
trained length (original_max_position_embeddings 16) the batch's positions (up
to 23) outgrow, so dynamic scaling is active and yarn's and llama3's ramps
cover several dimensions. yarn's factor 4 = 64 / 16, where transformers 4.4x
(factor from max_position_embeddings / original) and 5 (factor as given) agree."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import as_arrays, make_batch, make_model, rel_err, run_driver
from qwen2_ref import Qwen2Ref
from test_ref_grads import ref_backward

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-af": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2,
                "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def scaled_model(md, name, shape="qwen2-gqa1-d64-tied-f32"):
    cfg = make_model(md, shape)
    cfg_path = os.path.join(md, "config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["rope_theta"] = 10000.0
    c["max_position_embeddings"] = 64  # the extended length; the trained one is original_max_position_embeddings
    c["rope_scaling"] = SCALINGS[name]
    with open(cfg_path, "w") as f:
        json.dump(c, f)
    return cfg


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_forward_and_gradients(tmp_path, name):
    md = str(tmp_path / "model")
    cfg = scaled_model(md, name)
    batch = make_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "eval")
    a = as_arrays(batch)
    assert a["positions"].max() >= 16
    ref = Qwen2Ref(md)
    with torch.no_grad():
        loss, n, lp = ref.loss(a["inputs"], a["targets"], a["positions"], a["doc_start"])
    assert abs(out["loss_sum"][0] - loss.item()) <= 1e-5 * abs(loss.item())
    mask = a["targets"] != -100
    lp = lp.numpy()
    assert (np.abs(out["logp"] - lp)[mask] / np.abs(lp[mask])).max() <= 1e-5
    # the scaling changes the result: plain RoPE is far from it
    plain = Qwen2Ref(md)
    plain.rope_scaling = None
    with torch.no_grad():
        loss0, _, _ = plain.loss(a["inputs"], a["targets"], a["positions"], a["doc_start"])
    assert abs(loss0.item() - loss.item()) > 1e-4 * abs(loss.item())
    # training: every gradient through the scaled rotation
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--grad-scale", "0.25", tag="train")
    ref = Qwen2Ref(md)
    loss = ref_backward(ref, batch, 0.25)
    assert abs(out["loss_sum"][0] - loss) <= 1e-5 * abs(loss)
    worst = max((rel_err(out["grad/" + k], ref.p[k].grad.numpy()), k) for k in ref.p)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])


@pytest.mark.parametrize("name", ["linear", "yarn", "yarn-af", "llama3"])
def test_decode_kv_cache(tmp_path, name):
    """Generation's path: each decoding step's logits equal the full-sequence reference's.
    (Dynamic scaling depends on the longest position of each call, in transformers as here, so
    one token at a time differs from one full pass by design; it is held in the forward test.)"""
    md = str(tmp_path / "model")
    cfg = scaled_model(md, name)
    batch = make_batch(cfg["vocab_size"], B=1, T=24, packed=False)
    out = run_driver(str(tmp_path), md, batch, "--mode", "decode")
    a = as_arrays(batch)
    with torch.no_grad():
        lg = Qwen2Ref(md).logits(a["inputs"]).numpy()[0]
    P = 12
    want = lg[P - 1:]
    assert out["logits"].shape == want.shape
    assert rel_err(out["logits"], want) <= 1e-5


def test_unsupported_type_keeps_the_field(tmp_path):
    """A type qtune does not implement is refused, and the message does not suggest deleting it."""
    import subprocess
    from conftest import QTUNE
    md = str(tmp_path / "model")
    scaled_model(md, "linear")
    with open(os.path.join(md, "config.json")) as f:
        c = json.load(f)
    c["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    with open(os.path.join(md, "config.json"), "w") as f:
        json.dump(c, f)
    p = subprocess.run([QTUNE, "plan", "--model", md], capture_output=True, text=True)
    assert p.returncode != 0
    assert "rope_scaling type 'longrope' is not supported yet" in p.stderr
    assert "null" not in p.stderr and "remove" not in p.stderr and "delete" not in p.stderr
