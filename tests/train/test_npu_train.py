"""The Ascend backend ("device": "npu", issue 45) on whole training runs,
through the CPU stand-in of CANN's API (tests/unit/backend_parity/
acl_standin.c, loaded with QTUNE_ASCEND_LIB): the backend's own code (every
aclnn call, workspace, stream and tensor it makes) runs here, without CANN or
a card, against the CPU backend. What it shows is that the backend keeps the
API's documented rules as the stand-in holds them; not that it runs on an
Ascend card, which it never has.

The recipe's path: fp16 with dynamic loss scaling, LoRA and full fine-tuning,
20 steps on the tiny preset (the full run with packing, so the attention's
masked form runs too). The stand-in computes in fp32 in its own summation
order, as a GPU does, so the bounds are tests/gpu/test_gpu_train.py's for
16-bit runs: per-step losses within 1e-4 relative; each final tensor within
1e-2 relative, or 2 * 20 * LR absolute (no 20 Adam steps move a weight
further: the biases of k_proj, whose exact gradient is zero, move by
rounding noise; and a LoRA element whose gradient's sign flips with a
16-bit rounding, which Adam turns into a step of ~LR: measured once, on
this job without dropout, one of 256 elements of layers.0.v_proj.lora_B,
1e-4 absolute, the median element 3e-4 relative). The LoRA run has dropout
0.1 on q/v, as the GPU test: its mask is the CPU's, bit for bit. Measured
here (2026-12-06): LoRA losses within 2.3e-6 relative, tensors within
1.1e-3; full (packed) losses within 2.6e-6, k_proj.bias 3.2e-4 absolute."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trainutil as tu  # noqa: E402
from trainutil import st  # noqa: E402

BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(tu.SRC, "build"))
STANDIN = os.path.join(BUILD, "tests", "acl_standin", "libqtune_acl_standin.so")
LR = 5e-5  # the trainer's default learning rate, which these jobs keep


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    assert os.path.exists(STANDIN), "build the tests first: %s is missing" % STANDIN
    d = tmp_path_factory.mktemp("npu")
    model = tu.init_model(str(d / "model"), preset="tiny")
    data = str(d / "train.jsonl")
    tu.write_tokens(data, 64, 32, seed=5)
    return d, model, data


def train(d, model, data, mode, device, prec="fp16"):
    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]} \
        if mode == "lora" else None
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, prec: {"enabled": True}}
    out = str(d / ("run-%s-%s-%s" % (mode, prec, device)))
    job = tu.write_job(str(d / ("%s-%s-%s.json" % (mode, prec, device))), model, out, data, T=32, lora=lora, ds=ds,
                       train_opts={"max_steps": 20, "save_steps": 0, "resume": "never"},
                       data_opts={"packing": mode == "full"})
    with open(job) as f:
        j = json.load(f)
    j["device"] = device
    with open(job, "w") as f:
        json.dump(j, f)
    e = tu.env()
    e.pop("QTUNE_BACKEND", None)
    e["QTUNE_ASCEND_LIB"] = STANDIN
    if device == "cpu" and prec == "bf16":
        e["QTUNE_BF16_EMULATE"] = "1"  # the CPU reference the same on any host, as tests/gpu/ does
    p = subprocess.run([tu.QTUNE, "train", job], capture_output=True, text=True, env=e, timeout=900)
    assert p.returncode == 0, "%s on %s: %s" % (mode, device, p.stderr)
    return out


def final_tensors(out):
    dd = os.path.join(out, "final")
    f = "adapter_model.safetensors" if os.path.exists(os.path.join(dd, "adapter_model.safetensors")) else \
        "model.safetensors"
    return st.read(os.path.join(dd, f))


@pytest.mark.parametrize("mode,prec", [("lora", "fp16"), ("full", "fp16"), ("lora", "bf16")])
def test_16bit_20_steps_match_cpu(setup, mode, prec):
    """fp16 (the recipe's) LoRA and full; bf16 LoRA on the default Ascend910B1, which has it."""
    d, model, data = setup
    outs = {dev: train(d, model, data, mode, dev, prec) for dev in ("cpu", "npu")}
    lc = [m["loss"] for m in tu.step_lines(outs["cpu"])]
    ln = [m["loss"] for m in tu.step_lines(outs["npu"])]
    assert len(lc) == len(ln) == 20
    worst = max(abs(a - b) / abs(a) for a, b in zip(lc, ln))
    ref, got = final_tensors(outs["cpu"]), final_tensors(outs["npu"])
    assert sorted(ref) == sorted(got)
    wt, name = max((rel(ref[k], got[k]), k) for k in ref)
    print("npu %s %s: worst per-step loss difference %.3g relative; worst final tensor %.3g relative (%s, %.3g "
          "absolute)" % (mode, prec, worst, wt, name, float(np.max(np.abs(ref[name] - got[name])))))
    assert worst <= 1e-4
    bad = [k for k in ref if rel(ref[k], got[k]) > 1e-2 and float(np.max(np.abs(ref[k] - got[k]))) > 2 * 20 * LR]
    assert not bad, "%s: tensors beyond both bounds: %s" % (mode, bad)


@pytest.mark.parametrize("prec,says", [
    ("bf16", "this NPU (Ascend910A) has no bfloat16; train in fp16"),
    ("fp16", "attention runs through aclnnFlashAttentionScore, which CANN documents for Atlas A2 / A3 cards "
             "(Ascend910B, Ascend910_93) only, and this NPU is Ascend910A")])
def test_card_without_bf16_or_fused_attention(setup, prec, says):
    """On a card outside Atlas A2 / A3 (the stand-in's Ascend910A): bf16 is refused at the first cast, and
    fp16 training stops at the first attention (aclnnFlashAttentionScore is documented for Atlas A2 only),
    each with one sentence naming the card, exit 1."""
    d, model, data = setup
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, prec: {"enabled": True}}
    job = tu.write_job(str(d / ("910a-%s.json" % prec)), model, str(d / ("run-910a-%s" % prec)), data, T=32, ds=ds,
                       train_opts={"max_steps": 1, "save_steps": 0, "resume": "never"})
    with open(job) as f:
        j = json.load(f)
    j["device"] = "npu"
    with open(job, "w") as f:
        json.dump(j, f)
    e = tu.env()
    e.pop("QTUNE_BACKEND", None)
    e.update(QTUNE_ASCEND_LIB=STANDIN, QTUNE_ACL_STANDIN_SOC="Ascend910A")
    p = subprocess.run([tu.QTUNE, "train", job], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 1 and says in p.stderr, p.stderr


def test_generate_and_eval_match_cpu(setup):
    """Decoding (matvec, attention against the KV cache: FlashAttentionScore with sparse mode 3) and eval (the
    lm_head + cross-entropy forward) of a model trained 40 steps on the CPU: the same greedy ids as the CPU and
    the same eval loss within 1e-6 relative."""
    d, model, data = setup
    out = str(d / "gen-train")
    job = tu.write_job(str(d / "gen.json"), model, out, data, T=32,
                       train_opts={"max_steps": 40, "save_steps": 0, "resume": "never"})
    tu.run("train", job)
    e = tu.env()
    e.pop("QTUNE_BACKEND", None)
    e["QTUNE_ASCEND_LIB"] = STANDIN
    ids, loss = {}, {}
    for dev in ("cpu", "npu"):
        g = subprocess.run([tu.QTUNE, "generate", "--model", os.path.join(out, "final"), "--prompt-ids", "5,7,9,11",
                            "--max-new", "16", "--temperature", "0", "--device", dev], capture_output=True, text=True,
                           env=e, timeout=300)
        assert g.returncode == 0, g.stderr
        ids[dev] = g.stdout.split()
        v = subprocess.run([tu.QTUNE, "eval", "--model", os.path.join(out, "final"), "--data", data, "--seq-len", "32",
                            "--device", dev], capture_output=True, text=True, env=e, timeout=300)
        assert v.returncode == 0, v.stderr
        loss[dev] = json.loads(v.stdout.strip().splitlines()[-1])["loss"]
    print("generate: cpu %s, npu %s; eval loss cpu %.9g, npu %.9g" % (" ".join(ids["cpu"]), " ".join(ids["npu"]),
                                                                      loss["cpu"], loss["npu"]))
    assert ids["cpu"] == ids["npu"] and len(ids["cpu"]) == 16
    assert abs(loss["cpu"] - loss["npu"]) <= 1e-6 * abs(loss["cpu"])
