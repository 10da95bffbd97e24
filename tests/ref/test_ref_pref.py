"""Preference objectives against TRL's formulas on the PyTorch reference
(float64 autograd): DPO (sigmoid, ipo, hinge, robust, reference-free), ORPO
and SimPO on a batch of pairs (rows 0..P-1 chosen, P..2P-1 rejected, prompt
tokens unlabelled). qtune's loss, reward sums and every LoRA gradient within
1e-5 (relative); the DPO reference is the base model (the adapter off). Full
fine-tuning: the loss, the reward sums and every gradient; DPO's reference
there is the starting weights (what precompute_ref_log_probs computes before
step 1), which at this one step are the policy's own weights."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, rel_err, run_driver
from qwen1_ref import reference

P, T, R, ALPHA = 3, 20, 4, 8


def pair_batch(V, seed=3):
    """P prompts of 4..7 tokens, each with a chosen and a rejected answer of 3..10 tokens, padded to T."""
    rng = np.random.default_rng(seed)
    rows = [None] * (2 * P)
    for i in range(P):
        prompt = list(rng.integers(0, V, rng.integers(4, 8)))
        for side in (0, 1):
            ans = list(rng.integers(0, V, rng.integers(3, 11)))
            rows[side * P + i] = (prompt, ans)
    inputs, targets = np.zeros((2 * P, T), np.int64), np.full((2 * P, T), -100, np.int64)
    for r, (prompt, ans) in enumerate(rows):
        ids = prompt + ans
        inputs[r, :len(ids)] = ids
        for t in range(len(prompt) - 1, len(ids) - 1):
            targets[r, t] = ids[t + 1]
    pos = np.tile(np.arange(T), (2 * P, 1))
    return {"B": 2 * P, "T": T, "inputs": inputs.ravel().tolist(), "targets": targets.ravel().tolist(),
            "positions": pos.ravel().tolist(), "doc_start": [0] * (2 * P * T)}


def seq_logps(model, batch):
    """Per-row summed log-prob of the labelled targets and the token counts."""
    ids = np.array(batch["inputs"]).reshape(2 * P, T)
    tg = np.array(batch["targets"]).reshape(2 * P, T)
    lg = model.logits(ids)
    t = torch.as_tensor(tg)
    mask = t != -100
    lp = torch.log_softmax(lg, -1).gather(-1, t.clamp(min=0)[..., None])[..., 0] * mask
    return lp.sum(-1), mask.sum(-1).to(lp.dtype)


def trl_objective(obj, pol, n, ref):
    """TRL's DPOTrainer / ORPOTrainer / CPOTrainer(loss_type="simpo") loss and metrics, per the published code."""
    kind, beta, ls = obj["type"], obj.get("beta", 0.1), obj.get("label_smoothing", 0.0)
    nc = n[:P]
    avg = kind in ("orpo", "simpo") or obj.get("loss_type") == "ipo"
    lp = pol / n if avg else pol
    c, r = lp[:P], lp[P:]
    nll = -pol[:P].sum() / nc.sum()
    out = {}
    if kind == "dpo":
        rl = ref / n if avg else ref
        rc, rr = (rl[:P], rl[P:]) if not obj.get("reference_free") else (0 * c, 0 * r)
        z = (c - r) - (rc - rr)
        lt = obj.get("loss_type", "sigmoid")
        if lt == "sigmoid":
            losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
        elif lt == "robust":
            losses = (-F.logsigmoid(beta * z) * (1 - ls) + F.logsigmoid(-beta * z) * ls) / (1 - 2 * ls)
        elif lt == "hinge":
            losses = torch.relu(1 - beta * z)
        else:
            losses = (z - 1 / (2 * beta)) ** 2
        loss = losses.mean()
        rew_c, rew_r = beta * (c - rc), beta * (r - rr)
    elif kind == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        loss = nll - (beta * ratio).mean()
        rew_c, rew_r = beta * c, beta * r
        out["log_odds_ratio"] = ratio.sum()
        out["log_odds_chosen"] = log_odds.sum()
    else:
        z = (c - r) - obj.get("simpo_gamma", 0.5) / beta
        losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
        loss = losses.mean() + obj.get("cpo_alpha", 0.0) * nll
        rew_c, rew_r = beta * c, beta * r
    out.update({"loss": loss, "rewards_chosen": rew_c.sum(), "rewards_rejected": rew_r.sum(),
                "accuracies": (rew_c > rew_r).double().sum(), "margins": (rew_c - rew_r).sum(),
                "logps_chosen": c.sum(), "logps_rejected": r.sum()})
    return out


SUMS = ["loss", "rewards_chosen", "rewards_rejected", "accuracies", "margins", "logps_chosen", "logps_rejected",
        "nll", "log_odds_ratio", "log_odds_chosen"]

OBJECTIVES = {
    "dpo-sigmoid": {"type": "dpo", "beta": 0.1},
    "dpo-sigmoid-ls": {"type": "dpo", "beta": 0.3, "label_smoothing": 0.2},
    "dpo-robust": {"type": "dpo", "beta": 0.2, "loss_type": "robust", "label_smoothing": 0.1},
    "dpo-hinge": {"type": "dpo", "beta": 0.05, "loss_type": "hinge"},
    "dpo-ipo": {"type": "dpo", "beta": 0.5, "loss_type": "ipo"},
    "dpo-reference-free": {"type": "dpo", "beta": 0.1, "reference_free": True},
    "orpo": {"type": "orpo", "beta": 0.2},
    "simpo": {"type": "simpo", "beta": 2.0, "simpo_gamma": 0.8},
    "simpo-nll": {"type": "simpo", "beta": 2.5, "simpo_gamma": 0.5, "cpo_alpha": 1.0, "label_smoothing": 0.1},
}


def lora_weights(cfg, seed=7):
    """A non-zero adapter on q_proj and v_proj (B = 0 would make the policy the reference)."""
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or C // H
    rng = np.random.default_rng(seed)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for mod, out in (("q_proj", H * D), ("v_proj", KV * D)):
            key = "base_model.model.model.layers.%d.self_attn.%s" % (l, mod)
            w[key + ".lora_A.weight"] = (rng.standard_normal((R, C)) * 0.3).astype(np.float32)
            w[key + ".lora_B.weight"] = (rng.standard_normal((out, R)) * 0.3).astype(np.float32)
    return w


def save_adapter(path, w):
    import os
    import st
    os.makedirs(path, exist_ok=True)
    st.write(os.path.join(path, "adapter_model.safetensors"), w)
    json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none",
               "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"},
              open(os.path.join(path, "adapter_config.json"), "w"))


def check_sums(out, want, obj, pol, n, ref, skip=()):
    """qtune's loss and metric sums (pref/sums) against TRL's."""
    got = dict(zip(SUMS, out["pref/sums"].tolist()))
    # rewards and margins are differences of fp32 sequence sums (qtune computes in fp32, the reference in
    # fp64): held to 1e-5 of the sums they are made of, beta * sum |log-prob|
    avg = obj["type"] in ("orpo", "simpo") or obj.get("loss_type") == "ipo"
    made_of = float((pol.detach() / (n if avg else 1)).abs().sum() + (0 if avg or ref is None else ref.abs().sum()))
    for k in SUMS:
        if k not in want or k in skip:
            continue
        a, b = got[k], float(want[k])
        scale = abs(b) if k in ("loss", "accuracies", "nll") else max(abs(b), obj.get("beta", 0.1) * made_of)
        assert abs(a - b) <= 1e-5 * max(scale, 1e-3), "%s: %.9g vs TRL %.9g" % (k, a, b)


@pytest.mark.parametrize("shape", ["qwen2-gqa1-d64-tied-f32", "qwen3-gqa2-d48-tied-f32"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_pref_lora_matches_trl(tmp_path, shape, name):
    obj = OBJECTIVES[name]
    md = str(tmp_path / "model")
    cfg = make_model(md, shape)
    w = lora_weights(cfg)
    save_adapter(str(tmp_path / "adapter"), w)
    batch = pair_batch(cfg["vocab_size"])
    S = 0.5  # a loss scale: the gradients come out times S
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--adapter", str(tmp_path / "adapter"),
                     "--grad-scale", str(S), "--pref", json.dumps(obj))
    pol_model = reference(md, lora={"r": R, "alpha": ALPHA, "weights": w})
    pol, n = seq_logps(pol_model, batch)
    with torch.no_grad():
        ref, _ = seq_logps(reference(md), batch)  # the base model: PEFT's disable_adapter()
    want = trl_objective(obj, pol, n, ref)
    want["nll"] = -pol[:P].sum() if obj["type"] in ("orpo", "simpo") else torch.tensor(0.0)
    (want["loss"] * S).backward()

    assert rel_err(out["pref/policy"], pol.detach().numpy()) <= 1e-5
    if obj["type"] == "dpo" and not obj.get("reference_free"):
        assert rel_err(out["pref/ref"], ref.numpy()) <= 1e-5
    check_sums(out, want, obj, pol, n, ref)
    # fp32 against fp64 autograd: the SFT gradient tests allow 1e-4, these reach 1.1e-5 at worst
    worst = max((rel_err(out["grad/" + k], pol_model.lp[k].grad.numpy()), k) for k in w)
    assert worst[0] <= 2e-5, "gradient %s rel err %.3g" % (worst[1], worst[0])



@pytest.mark.parametrize("shape", ["qwen2-gqa2-d64-untied-bf16", "qwen3-gqa2-d48-tied-f32"])
@pytest.mark.parametrize("name", ["dpo-sigmoid", "dpo-ipo", "orpo", "simpo-nll", "dpo-reference-free"])
def test_pref_full_ft_matches_trl(tmp_path, shape, name):
    """Full fine-tuning: the loss, TRL's metric sums and every gradient, the lm_head's row by row included.
    DPO's reference is the starting weights: the driver's reference forward runs the weights it trains, so
    here the policy's log-probs, detached."""
    obj = OBJECTIVES[name]
    md = str(tmp_path / "model")
    cfg = make_model(md, shape)
    batch = pair_batch(cfg["vocab_size"])
    out = run_driver(str(tmp_path), md, batch, "--mode", "train", "--pref", json.dumps(obj))
    model = reference(md)
    pol, n = seq_logps(model, batch)
    ref = pol.detach().clone() if obj["type"] == "dpo" and not obj.get("reference_free") else None
    want = trl_objective(obj, pol, n, ref)
    want["nll"] = -pol[:P].sum() if obj["type"] in ("orpo", "simpo") else torch.tensor(0.0)
    want["loss"].backward()
    assert rel_err(out["pref/policy"], pol.detach().numpy()) <= 1e-5
    if ref is not None:
        assert rel_err(out["pref/ref"], ref.numpy()) <= 1e-5
    # with the policy as its own reference every pair ties (rewards 0): which side fp32 puts ahead is noise,
    # so rewards/accuracies is not held there
    check_sums(out, want, obj, pol, n, ref, skip=("accuracies",) if ref is not None else ())
    names = {k[5:] for k in out if k.startswith("grad/")}
    assert names == set(model.p)
    worst = max((rel_err(out["grad/" + k], model.p[k].grad.numpy()), k) for k in names)
    assert worst[0] <= 1e-4, "gradient %s rel err %.3g" % (worst[1], worst[0])
