"""qtune train with PEFT's modules_to_save and layers_to_transform:
  - 20 optimizer steps against the PyTorch reference (test_train_ref's
    AdamW / clipping / WarmupDecayLR loop): the saved modules and LoRA's
    weights after 20 steps and the loss at every step within the LoRA
    reference test's 1e-4;
  - the adapter folder as PEFT writes it (keys, adapter_config.json), eval
    --adapter equal to the training's final eval, merge equal to eval
    --adapter (a tied model comes out untied), resume exact;
  - job-file errors: a layers_pattern of another architecture, a module
    modules_to_save cannot train."""
import json
import os

import numpy as np
import pytest
import torch

from trainutil import init_model, metrics, run, st, write_job, write_tokens
from test_train_ref import DS, N_EX, STEPS, T, check, reference

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)


def peft_start(model, r, targets, layers, seed=5):
    """A non-zero starting adapter (init_from) on `layers` only, and its tensors."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["model_type"] == "qwen":
        D = cfg["kv_channels"]
        mods = [("transformer.h.%d.attn.c_attn", C, 3 * H * D)]
    else:
        D, KV = cfg.get("head_dim") or C // H, cfg["num_key_value_heads"]
        mods = [("model.layers.%d.self_attn.q_proj", C, H * D), ("model.layers.%d.self_attn.v_proj", C, KV * D)]
    rng = np.random.default_rng(seed)
    w = {}
    for l in layers:
        for mod, fan_in, out in mods:
            key = "base_model.model." + mod % l
            w[key + ".lora_A.weight"] = (rng.standard_normal((r, fan_in)) * 0.2).astype(np.float32)
            w[key + ".lora_B.weight"] = (rng.standard_normal((out, r)) * 0.2).astype(np.float32)
    ad = os.path.join(os.path.dirname(model), "adapter0")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"), w)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
               "target_modules": targets, "task_type": "CAUSAL_LM", "layers_to_transform": layers},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    return cfg, w


@pytest.mark.parametrize("preset,save,layers,pattern", [
    ("tiny", ["embed_tokens", "lm_head"], [1], "layers"),    # tied: two separate trained copies
    ("tiny", ["embed_tokens"], [0, 1], None),                 # tied: the lm_head stays the frozen base embedding
    ("tiny-llama", ["lm_head"], [0], None),
    ("tiny-qwen", ["wte", "lm_head"], [1], "h"),
])
def test_20_steps_match_reference(tmp_path, preset, save, layers, pattern):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    rows = write_tokens(os.path.join(d, "train.jsonl"), N_EX, T, seed=11, min_len=5)
    r = 4
    targets = ["c_attn"] if preset == "tiny-qwen" else ["q_proj", "v_proj"]
    cfg, w = peft_start(model, r, targets, layers)
    lora = {"r": r, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets, "init_from": "adapter0",
            "modules_to_save": save, "layers_to_transform": layers, "layers_pattern": pattern}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=T, lora=lora, ds=DS,
                    train_opts={"max_steps": STEPS})
    run("train", job)

    # the reference: PEFT's wrapper copies each saved module from the base (init_from holds none)
    base = st.read(os.path.join(model, "model.safetensors"))
    emb = "transformer.wte.weight" if cfg["model_type"] == "qwen" else "model.embed_tokens.weight"
    start = dict(w)
    for s in save:
        key = "base_model.model." + (emb if s != "lm_head" else "lm_head.weight")
        start[key] = base[emb if s != "lm_head" or cfg.get("tie_word_embeddings") else "lm_head.weight"]
    ref = qwen1_ref.reference(model, dtype=torch.float64, lora={"r": r, "alpha": 8, "weights": start})
    losses = reference(ref, rows)
    final = st.read(os.path.join(d, "out", "final", "adapter_model.safetensors"))
    assert set(final) == set(start), set(final) ^ set(start)
    ours = {k: (final[k], ref.lp[k].detach().numpy()) for k in final}
    worst = check(ours, losses, os.path.join(d, "out"))
    for s in save:  # the saved modules did train
        key = "base_model.model." + (emb if s != "lm_head" else "lm_head.weight")
        assert np.abs(final[key] - start[key]).max() > 1e-3, key
    print("%s %s: max |w - w_ref| = %.3g" % (preset, save, worst))


def eval_loss(*args):
    p = run("eval", *args)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_adapter_folder_eval_merge_resume(tmp_path):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), "tiny")  # tied embeddings, as Qwen2.5-0.5B
    write_tokens(os.path.join(d, "train.jsonl"), 24, 16, seed=1, min_len=4)
    write_tokens(os.path.join(d, "eval.jsonl"), 8, 16, seed=2)
    lora = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
            "modules_to_save": ["embed_tokens", "lm_head"], "layers_to_transform": [1], "layers_pattern": "layers"}
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", eval_="eval.jsonl", lora=lora,
                    ds=ds, train_opts={"max_steps": 6, "save_steps": 3})
    run("train", job)
    fin = os.path.join(d, "out", "final")
    c = json.load(open(os.path.join(fin, "adapter_config.json")))
    assert c["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert c["layers_to_transform"] == [1] and c["layers_pattern"] == "layers"
    w = st.read(os.path.join(fin, "adapter_model.safetensors"))
    assert set(w) == {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight",
                      "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
                      "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
                      "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
                      "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"}
    assert w["base_model.model.lm_head.weight"].shape == (512, 64)
    assert not np.array_equal(w["base_model.model.lm_head.weight"], w["base_model.model.model.embed_tokens.weight"])

    # eval --adapter gives the training's last eval
    last = [m for m in metrics(os.path.join(d, "out")) if "eval_loss" in m][-1]
    data = os.path.join(d, "eval.jsonl")
    with_adapter = eval_loss("--model", model, "--adapter", fin, "--data", data, "--seq-len", 16)
    assert abs(with_adapter["loss"] - last["eval_loss"]) <= 1e-5 * last["eval_loss"], (with_adapter, last)

    # merge: the trained copies replace the base's, and the tied model is written untied
    merged = os.path.join(d, "merged")
    run("merge", "--model", model, "--adapter", fin, "--out", merged)
    mw = st.read(os.path.join(merged, "model.safetensors"))
    assert np.array_equal(mw["lm_head.weight"], w["base_model.model.lm_head.weight"])
    assert np.array_equal(mw["model.embed_tokens.weight"], w["base_model.model.model.embed_tokens.weight"])
    assert json.load(open(os.path.join(merged, "config.json")))["tie_word_embeddings"] is False
    folded = eval_loss("--model", merged, "--data", data, "--seq-len", 16)
    assert folded["tokens"] == with_adapter["tokens"] > 0
    assert abs(folded["loss"] - with_adapter["loss"]) <= 1e-5 * with_adapter["loss"]

    # resume from checkpoint-3 ends where the straight run ended, bit for bit
    job2 = write_job(os.path.join(d, "job2.json"), "model", "out2", "train.jsonl", eval_="eval.jsonl", lora=lora,
                     ds=ds, train_opts={"max_steps": 3, "save_steps": 3})
    run("train", job2)
    job2 = write_job(os.path.join(d, "job2.json"), "model", "out2", "train.jsonl", eval_="eval.jsonl", lora=lora,
                     ds=ds, train_opts={"max_steps": 6, "save_steps": 3})
    run("train", job2)
    w2 = st.read(os.path.join(d, "out2", "final", "adapter_model.safetensors"))
    for k in w:
        assert np.array_equal(w[k], w2[k]), k


@pytest.mark.parametrize("extra,msg", [
    ({"layers_to_transform": [1], "layers_pattern": "h"}, "layers_pattern 'h' does not match this Qwen2ForCausalLM"),
    ({"modules_to_save": ["norm"]}, "modules_to_save names 'norm'"),
    ({"layers_to_transform": [2]}, "layers_to_transform lists layer 2, but the model has 2 layers"),
    ({"layers_pattern": "layers"}, "layers_pattern is set but layers_to_transform is not"),
])
def test_job_errors(tmp_path, extra, msg):
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=1)
    lora = dict({"r": 4, "target_modules": ["q_proj"]}, **extra)
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", lora=lora)
    p = run("train", job, check=False)
    assert p.returncode != 0 and msg in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "out", "final"))
