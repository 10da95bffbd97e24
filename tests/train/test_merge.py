"""qtune merge: W' = W + (B @ A) * scaling in fp32 then cast, as peft's
merge_and_unload; the merged model evaluates like base + adapter."""
import json
import os

import numpy as np
import pytest

from trainutil import init_model, run, st, write_job, write_tokens


def eval_loss(*args):
    p = run("eval", *args)
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rslora", [False, True])
def test_merge_matches_adapter(tmp_path, rslora):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 16, 16, seed=1)
    write_tokens(os.path.join(d, "eval.jsonl"), 8, 16, seed=2)
    lora = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.0, "use_rslora": rslora,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", lora=lora, ds=ds,
                    train_opts={"max_steps": 4})
    run("train", job)
    adapter = os.path.join(d, "out", "final")
    merged = os.path.join(d, "merged")
    run("merge", "--model", model, "--adapter", adapter, "--out", merged)

    # weights: numpy's W + B @ A * scaling
    base = st.read(os.path.join(model, "model.safetensors"))
    ad = st.read(os.path.join(adapter, "adapter_model.safetensors"))
    out = st.read(os.path.join(merged, "model.safetensors"))
    assert set(out) == set(base)
    scaling = 16 / (np.sqrt(4) if rslora else 4)
    n_merged = 0
    for k, w in base.items():
        key = "base_model.model." + k[:-len(".weight")]
        if key + ".lora_A.weight" in ad:
            a, b = ad[key + ".lora_A.weight"].astype(np.float64), ad[key + ".lora_B.weight"].astype(np.float64)
            want = w + (b @ a) * scaling
            assert np.allclose(out[k], want, rtol=1e-5, atol=1e-6), k
            assert not np.allclose(out[k], w), k
            n_merged += 1
        else:
            assert np.array_equal(out[k], w), k
    assert n_merged == 2 * 7
    assert os.path.exists(os.path.join(merged, "config.json"))

    # the merged model evaluates like base + adapter
    data = os.path.join(d, "eval.jsonl")
    with_adapter = eval_loss("--model", model, "--adapter", adapter, "--data", data, "--seq-len", 16)
    folded = eval_loss("--model", merged, "--data", data, "--seq-len", 16)
    plain = eval_loss("--model", model, "--data", data, "--seq-len", 16)
    assert with_adapter["tokens"] == folded["tokens"] > 0
    assert abs(with_adapter["loss"] - folded["loss"]) <= 1e-5 * with_adapter["loss"]
    assert abs(with_adapter["loss"] - plain["loss"]) > 1e-4  # the adapter changes something

    # --dtype casts every tensor and says so in config.json
    merged16 = os.path.join(d, "merged_bf16")
    run("merge", "--model", model, "--adapter", adapter, "--out", merged16, "--dtype", "bf16")
    assert set(st.read_dtypes(os.path.join(merged16, "model.safetensors")).values()) == {"BF16"}
    assert json.load(open(os.path.join(merged16, "config.json")))["torch_dtype"] == "bfloat16"


def test_merge_errors(tmp_path):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    p = run("merge", "--model", model, "--adapter", os.path.join(d, "nope"), "--out", os.path.join(d, "m"),
            check=False)
    assert p.returncode == 1 and "adapter_config.json" in p.stderr
    p = run("merge", "--model", model, check=False)
    assert p.returncode == 2
    # an adapter for another shape is refused by name
    ad = os.path.join(d, "ad")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"),
             {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 99), np.float32),
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)})
    json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    p = run("merge", "--model", model, "--adapter", ad, "--out", os.path.join(d, "m2"), check=False)
    assert p.returncode == 1 and "q_proj" in p.stderr
    assert not os.path.exists(os.path.join(d, "m2", "model.safetensors"))
