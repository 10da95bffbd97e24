"""Pre-quantized folders (transformers' bitsandbytes 4-bit layout, made by tests/quant/bnb_folder.py): they
load as they are; training on one equals training with the job's "quantization" on the 16-bit folder it came
from, bit for bit (the same 4-bit blocks); eval and generate read them; a folder that lies is refused in one
sentence. merge and export: test_merge_qlora.py."""
import json
import os
import sys

import numpy as np
import pytest

from trainutil import init_model, run, st, write_job, write_tokens

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "quant"))
import bnb_folder  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def train(d, model, out, quant=None, lora=LORA, steps=4, check=True):
    job = write_job(os.path.join(d, "job-%s.json" % out), model, out, "train.jsonl", lora=lora,
                    train_opts={"max_steps": steps})
    j = json.load(open(job))
    if quant:
        j["quantization"] = quant
    json.dump(j, open(job, "w"))
    return run("train", job, check=check)


@pytest.mark.parametrize("preset,qtype,nested", [("tiny", "nf4", True), ("tiny-qwen3", "fp4", False),
                                                 ("tiny-qwen", "nf4", True)])
def test_bnb_folder_trains_as_quantize_on_load(tmp_path, preset, qtype, nested):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    bnb = bnb_folder.bnb_folder(model, os.path.join(d, "bnb"), qtype, nested)
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    lora = dict(LORA, target_modules=["c_attn", "w2"]) if preset == "tiny-qwen" else LORA
    p = train(d, "bnb", "out_bnb", lora=lora)
    assert "reading 4-bit the base" in p.stderr or "4-bit base:" in p.stderr
    train(d, "model", "out_q", {"load_in_4bit": True, "bnb_4bit_quant_type": qtype,
                                "bnb_4bit_use_double_quant": nested}, lora=lora)
    a = st.read(os.path.join(d, "out_bnb", "final", "adapter_model.safetensors"))
    b = st.read(os.path.join(d, "out_q", "final", "adapter_model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    data = os.path.join(d, "train.jsonl")
    e = json.loads(run("eval", "--model", bnb, "--adapter", os.path.join(d, "out_bnb", "final"), "--data", data,
                       "--seq-len", 16).stdout.strip().splitlines()[-1])
    assert np.isfinite(e["loss"])
    plan = json.loads(run("plan", os.path.join(d, "job-out_bnb.json"), "--json").stdout)
    assert plan["base"] == ("4-bit, double-quantized" if nested else "4-bit")
    g = run("generate", "--model", bnb, "--prompt-ids", "5,6,7", "--max-new", 6, "--temperature", 0).stdout.split()
    assert len(g) == 6


def test_full_finetuning_of_a_bnb_folder_is_refused(tmp_path):
    d = str(tmp_path)
    bnb_folder.bnb_folder(init_model(os.path.join(d, "model"), "tiny"), os.path.join(d, "bnb"))
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    p = train(d, "bnb", "out", lora=None, check=False)
    assert p.returncode != 0 and "full fine-tuning cannot update it" in p.stderr, p.stderr


def lie(folder, fn):
    path = os.path.join(folder, "model.safetensors")
    t = bnb_folder.read_mixed(path)
    fn(t)
    bnb_folder.write_mixed(path, t)


def set_state(t, key, **kw):
    dt, raw = t[key]
    s = json.loads(bytes(raw).decode())
    s.update(kw)
    t[key] = ("U8", np.frombuffer(json.dumps(s).encode(), np.uint8))


Q = "model.layers.0.self_attn.q_proj.weight"
LIES = {
    "short absmax": (lambda t: t.__setitem__(Q + ".absmax", ("U8", t[Q + ".absmax"][1][:-1])),
                     "the folder does not match its quant_state"),
    "short codes": (lambda t: t.__setitem__(Q, ("U8", t[Q][1][:-1])), "bytes of 4-bit codes but its shape"),
    "quant_type int4": (lambda t: set_state(t, Q + ".quant_state.bitsandbytes__nf4", quant_type="int4"),
                        "the folder lies about its tensors"),
    "wrong shape": (lambda t: set_state(t, Q + ".quant_state.bitsandbytes__nf4", shape=[3, 7]),
                    "the folder lies about its tensors"),
    "blocksize 48": (lambda t: set_state(t, Q + ".quant_state.bitsandbytes__nf4", blocksize=48),
                     "power-of-two"),
    "no quant_state": (lambda t: t.pop(Q + ".quant_state.bitsandbytes__nf4"), "has no quant_state"),
}


@pytest.mark.parametrize("name", list(LIES) + ["config int4", "config 8-bit"])
def test_a_lying_folder_is_refused(tmp_path, name):
    d = str(tmp_path)
    bnb = bnb_folder.bnb_folder(init_model(os.path.join(d, "model"), "tiny"), os.path.join(d, "bnb"), "nf4", True)
    if name in LIES:
        lie(bnb, LIES[name][0])
        msg = LIES[name][1]
    else:
        cfg = json.load(open(os.path.join(bnb, "config.json")))
        if name == "config int4":
            cfg["quantization_config"]["bnb_4bit_quant_type"] = "int4"
            msg = "not nf4 or fp4"
        else:
            cfg["quantization_config"].update({"load_in_8bit": True, "load_in_4bit": False})
            msg = "8-bit (load_in_8bit)"
        json.dump(cfg, open(os.path.join(bnb, "config.json"), "w"))
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    p = train(d, "bnb", "out", check=False)
    assert p.returncode != 0 and msg in p.stderr, p.stderr
    assert len([l for l in p.stderr.strip().splitlines() if "error" in l.lower()]) <= 1, p.stderr
