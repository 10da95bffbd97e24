"""The training step against a PyTorch reference (tests/ref/qwen2_ref.py in
float64, torch.optim.AdamW, clip_grad_norm_, DeepSpeed's WarmupDecayLR):
20 optimizer steps of LoRA (init_from a non-zero adapter, dropout 0, no
shuffle) and 20 of full fine-tuning, 2 micro-batches of 2 rows per step, rows
of different lengths so the token-weighted mean over the accumulation window
(HF's gradient-accumulation fix) differs from a mean of micro-batch means.
Loss at every step within 1e-4 relative; final weights within 1e-4."""
import json
import math
import os

import numpy as np
import pytest
import torch

from trainutil import init_model, run, st, step_lines, write_job, write_tokens

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)

STEPS, B, A, T, N_EX = 20, 2, 2, 16, 24
LR_MIN, LR_MAX, WARMUP, WD, CLIP = 5e-4, 4e-3, 5, 0.01, 1.0
DS = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": A, "gradient_clipping": CLIP,
      "optimizer": {"type": "AdamW", "params": {"lr": LR_MAX, "betas": [0.9, 0.999], "eps": 1e-8,
                                                "weight_decay": WD}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": LR_MIN, "warmup_max_lr": LR_MAX,
                                                        "warmup_num_steps": WARMUP, "total_num_steps": STEPS,
                                                        "warmup_type": "linear"}}}


def ds_lr(it):
    """DeepSpeed WarmupDecayLR.get_lr() at last_batch_iteration = it (linear warmup)."""
    if it < 0:
        return LR_MIN
    W = max(2, WARMUP)
    if it < W:
        return LR_MIN + (LR_MAX - LR_MIN) * (it / W)
    return LR_MIN + (LR_MAX - LR_MIN) * max(0.0, (STEPS - it) / max(1.0, STEPS - W))


def reference(ref, rows):
    """Losses of STEPS steps; ref's trainables are updated in place."""
    params = ref.trainables()
    decay = [p for p in params.values() if p.dim() == 2]
    other = [p for p in params.values() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": WD}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=LR_MAX, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for s in range(STEPS):
        idx = [(s * A * B + i) % N_EX for i in range(A * B)]
        total, n = 0, 0
        for i in idx:
            ids = rows[i]
            tg = ids[1:] + [-100]
            ls, k, _ = ref.loss([ids], [tg])
            total = total + ls
            n += k
        loss = total / n
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        for g in opt.param_groups:
            g["lr"] = ds_lr(s - 1)  # the k-th update runs with lr(k - 1), as DeepSpeed's engine
        opt.step()
        losses.append(float(loss))
    return losses


def check(ours, theirs, out):
    got = [m["loss"] for m in step_lines(out)]
    assert len(got) == STEPS
    for s, (a, b) in enumerate(zip(got, theirs)):
        assert abs(a - b) <= 1e-4 * abs(b), "step %d: loss %.8f vs reference %.8f" % (s + 1, a, b)
    lrs = [m["lr"] for m in step_lines(out)]
    for s, lr in enumerate(lrs):
        assert abs(lr - ds_lr(s - 1)) <= 1e-9, "step %d: lr %g vs %g" % (s + 1, lr, ds_lr(s - 1))
    worst = 0.0
    for name, p in ours.items():
        q = theirs_w = p[1]
        d = np.abs(p[0] - q).max()
        worst = max(worst, d)
        assert np.allclose(p[0], theirs_w, rtol=1e-4, atol=1e-4), "%s differs by %g" % (name, d)
    return worst


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-qwen"])
def test_lora_20_steps_match_reference(tmp_path, preset):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    rows = write_tokens(os.path.join(d, "train.jsonl"), N_EX, T, seed=11, min_len=5)
    # a non-zero starting adapter (B = 0 would hide errors in dA)
    cfg = json.load(open(os.path.join(model, "config.json")))
    C, H, r = cfg["hidden_size"], cfg["num_attention_heads"], 4
    if cfg["model_type"] == "qwen":  # the original Qwen: fused c_attn (q, k, v) and both c_proj
        D, I = cfg["kv_channels"], cfg["intermediate_size"] // 2
        targets = ["c_attn", "c_proj"]
        mods = [("transformer.h.%d.attn.c_attn", C, 3 * H * D), ("transformer.h.%d.attn.c_proj", H * D, C),
                ("transformer.h.%d.mlp.c_proj", I, C)]
    else:
        D, KV = cfg.get("head_dim") or C // H, cfg["num_key_value_heads"]
        targets = ["q_proj", "v_proj"]
        mods = [("model.layers.%d.self_attn.q_proj", C, H * D), ("model.layers.%d.self_attn.v_proj", C, KV * D)]
    rng = np.random.default_rng(5)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for mod, fan_in, out in mods:
            key = "base_model.model." + mod % l
            w[key + ".lora_A.weight"] = (rng.standard_normal((r, fan_in)) * 0.2).astype(np.float32)
            w[key + ".lora_B.weight"] = (rng.standard_normal((out, r)) * 0.2).astype(np.float32)
    ad = os.path.join(d, "adapter0")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"), w)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
               "target_modules": targets, "task_type": "CAUSAL_LM"},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    lora = {"r": r, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets, "init_from": "adapter0"}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=T, lora=lora, ds=DS,
                    train_opts={"max_steps": STEPS})
    run("train", job)

    ref = qwen1_ref.reference(model, dtype=torch.float64, lora={"r": r, "alpha": 8, "weights": w})
    losses = reference(ref, rows)
    final = st.read(os.path.join(d, "out", "final", "adapter_model.safetensors"))
    assert set(final) == set(w)
    assert json.load(open(os.path.join(d, "out", "final", "adapter_config.json")))["target_modules"] == targets
    ours = {k: (final[k], ref.lp[k].detach().numpy()) for k in final}
    worst = check(ours, losses, os.path.join(d, "out"))
    print("LoRA: max |w - w_ref| = %.3g" % worst)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-qwen"])
def test_full_20_steps_match_reference(tmp_path, preset):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    rows = write_tokens(os.path.join(d, "train.jsonl"), N_EX, T, seed=12, min_len=5)
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=T, ds=DS,
                    train_opts={"max_steps": STEPS})
    run("train", job)
    ref = qwen1_ref.reference(model, dtype=torch.float64)
    losses = reference(ref, rows)
    final = st.read(os.path.join(d, "out", "final", "model.safetensors"))
    assert set(final) == set(ref.p), sorted(set(final) ^ set(ref.p))
    ours = {k: (final[k], ref.p[k].detach().numpy()) for k in final}
    worst = check(ours, losses, os.path.join(d, "out"))
    print("full: max |w - w_ref| = %.3g" % worst)
    # final/ is a model folder: config and the model's dtype
    assert os.path.exists(os.path.join(d, "out", "final", "config.json"))
    assert set(st.read_dtypes(os.path.join(d, "out", "final", "model.safetensors")).values()) == {"F32"}
