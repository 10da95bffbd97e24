"""LoRA on the original Qwen (QWenLMHeadModel) with PEFT's semantics: target
names are that model's own (c_attn, c_proj, w1, w2); Qwen2 names (the field
report's ["q_proj", "v_proj"]) stop `qtune train` before anything is loaded
or written, with one sentence naming the fused c_attn and the list to write,
and `qtune doctor` shows the same sentence; an absent target_modules is PEFT's
default for model_type qwen (c_attn); merge folds a c_attn adapter in."""
import json
import os

import numpy as np

from trainutil import init_model, run, st, write_job, write_tokens

DS = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}}


def make_job(tmp_path, targets):
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny-qwen")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=1)
    lora = {"r": 4, "lora_alpha": 8}
    if targets is not None:
        lora["target_modules"] = targets
    return d, write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", lora=lora, ds=DS,
                        train_opts={"max_steps": 2})


def test_qwen2_names_refused_before_loading(tmp_path):
    d, job = make_job(tmp_path, ["q_proj", "v_proj"])
    p = run("train", job, check=False)
    assert p.returncode == 1
    err = p.stderr.strip().splitlines()
    msg = [l for l in err if "q_proj, v_proj" in l]
    assert len(msg) == 1, p.stderr
    for part in ["do not exist in an original Qwen (QWenLMHeadModel) model", "one fused c_attn (q, k and v together)",
                 'write "target_modules": ["c_attn"]']:
        assert part in msg[0], msg[0]
    assert not os.path.exists(os.path.join(d, "out"))  # nothing claimed, loaded or written
    # every Qwen2 name maps to the original's: o_proj/down_proj -> c_proj, gate -> w2, up -> w1
    _, job2 = make_job(tmp_path / "b", ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    p = run("train", job2, check=False)
    assert 'write "target_modules": ["c_attn", "c_proj", "w2", "w1"]' in p.stderr, p.stderr
    # the doctor shows the same sentence for the job file, and lists it in its table
    p = run("doctor", job, check=False)
    assert p.returncode == 1 and msg[0].split("error: ")[-1] in p.stdout, p.stdout
    assert "LoRA on an original Qwen model" in run("doctor").stdout


def test_default_targets_are_c_attn_and_c_proj_matches_both(tmp_path):
    d, job = make_job(tmp_path, None)
    run("train", job)
    final = os.path.join(d, "out", "final")
    w = st.read(os.path.join(final, "adapter_model.safetensors"))
    assert sorted(w) == sorted("base_model.model.transformer.h.%d.attn.c_attn.lora_%s.weight" % (l, ab)
                               for l in range(2) for ab in "AB")
    assert w["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (4, 64)
    assert w["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (192, 4)
    assert json.load(open(os.path.join(final, "adapter_config.json")))["target_modules"] == ["c_attn"]
    d2, job2 = make_job(tmp_path / "b", ["c_proj", "w1"])
    run("train", job2)
    keys = set(st.read(os.path.join(d2, "out", "final", "adapter_model.safetensors")))
    assert {k.split(".lora_")[0].split(".", 5)[-1] for k in keys} == {"attn.c_proj", "mlp.c_proj", "mlp.w1"}
    # "all-linear": every linear of this layout, written back with its own names
    d3, job3 = make_job(tmp_path / "c", "all-linear")
    run("train", job3)
    final = os.path.join(d3, "out", "final")
    keys = set(st.read(os.path.join(final, "adapter_model.safetensors")))
    assert len(keys) == 2 * 2 * 5
    assert json.load(open(os.path.join(final, "adapter_config.json")))["target_modules"] == ["c_attn", "c_proj", "w1",
                                                                                            "w2"]


def test_merge_folds_c_attn(tmp_path):
    d, job = make_job(tmp_path, ["c_attn", "c_proj", "w1", "w2"])
    write_tokens(os.path.join(d, "eval.jsonl"), 6, 16, seed=2)
    run("train", job)
    adapter, merged, model = os.path.join(d, "out", "final"), os.path.join(d, "merged"), os.path.join(d, "model")
    run("merge", "--model", model, "--adapter", adapter, "--out", merged)
    base = st.read(os.path.join(model, "model.safetensors"))
    ad = st.read(os.path.join(adapter, "adapter_model.safetensors"))
    out = st.read(os.path.join(merged, "model.safetensors"))
    n = 0
    for k, wt in base.items():
        key = "base_model.model." + k[:-len(".weight")]
        if key + ".lora_A.weight" in ad:
            want = wt + ad[key + ".lora_B.weight"].astype(np.float64) @ ad[key + ".lora_A.weight"] * 2.0
            assert np.allclose(out[k], want, rtol=1e-5, atol=1e-6), k
            n += 1
        else:
            assert np.array_equal(out[k], wt), k
    assert n == 2 * 5  # c_attn, attn.c_proj, mlp.c_proj, w1, w2 in 2 layers
    assert json.load(open(os.path.join(merged, "config.json")))["architectures"] == ["QWenLMHeadModel"]
    data = os.path.join(d, "eval.jsonl")
    ev = lambda *a: json.loads(run("eval", *a, "--data", data, "--seq-len", 16).stdout.strip().splitlines()[-1])
    a, b = ev("--model", model, "--adapter", adapter), ev("--model", merged)
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]


def test_seq_len_past_seq_length_refused(tmp_path):
    """Dynamic NTK and logn attention switch on past seq_length; qtune says so instead of computing a
    different model."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), "tiny-qwen")
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg["seq_length"] = 8
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    write_tokens(os.path.join(d, "eval.jsonl"), 2, 16, seed=2)
    p = run("eval", "--model", model, "--data", os.path.join(d, "eval.jsonl"), "--seq-len", 16, check=False)
    assert p.returncode != 0 and "seq_length (8)" in p.stderr and "use_dynamic_ntk" in p.stderr, p.stderr
    run("eval", "--model", model, "--data", os.path.join(d, "eval.jsonl"), "--seq-len", 8)
    # the defaults stop at seq_length too: eval's --seq-len, generate's --ctx
    run("eval", "--model", model, "--data", os.path.join(d, "eval.jsonl"))
    p = run("generate", "--model", model, "--prompt-ids", "1,2,3", "--max-new", 3, check=False)
    assert p.returncode == 0, p.stderr
    p = run("generate", "--model", model, "--prompt-ids", "1,2,3", "--ctx", 16, check=False)
    assert p.returncode == 2 and "seq_length (8 in" in p.stderr, p.stderr
