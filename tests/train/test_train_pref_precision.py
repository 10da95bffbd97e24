"""DPO in fp16 and bf16 (docs/preference.md): a few steps of the same job as
fp32 on the tiny model of test_train_pref.py, LoRA (the reference: the adapter
off, from an init_from adapter) and full fine-tuning (the reference
precomputed in the run's precision), within the tolerances below of the fp32
run's loss and TRL's metrics at every step. The tolerances are a few times
what was measured (2026-12-06, this CPU; the figures are beside TOL)."""
import json
import os

from test_train_pref import adapter, make_model, pairs, write_job, write_pairs
from test_train_pref import needs_qwen_tokenizer as pytestmark  # noqa: F401
from trainutil import run, step_lines

STEPS = 4


def has_bf16():
    try:
        return "avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# |half - fp32| allowed: loss (nats), logps (relative), rewards/margins (absolute; beta 0.1 times logps).
# Measured worst over the 4 steps (2026-12-06): fp16 loss 5.7e-5, logps 1.2e-5, rewards 1.1e-4 (LoRA);
# bf16 loss 8.5e-5, logps 3.9e-5, rewards 1.7e-4 (full). The tiny random model's log-probs sit near
# -log(vocab) per token, so these are smaller than on a trained model.
TOL = {"fp16": {"loss": 5e-4, "logps": 1e-4, "rewards": 5e-4},
       "bf16": {"loss": 5e-4, "logps": 2e-4, "rewards": 1e-3}}


def precision_runs(d, full):
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    if not full:
        adapter(d, json.load(open(os.path.join(d, "config.json"))))
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo", "beta": 0.1}, max_steps=STEPS)
    if full:
        cfg = json.load(open(job))
        del cfg["lora"]
        cfg["deepspeed"]["optimizer"]["params"]["lr"] = 1e-3
        json.dump(cfg, open(job, "w"))
    out = {}
    precs = ["fp32", "fp16"] + (["bf16"] if has_bf16() else [])  # bf16 on the CPU needs AVX512_BF16
    for prec in precs:
        sets = [] if prec == "fp32" else ["--set", "deepspeed.%s={\"enabled\": true%s}" % (
            prec, ", \"initial_scale_power\": 8" if prec == "fp16" else "")]
        p = run("train", job, "--set", "output_dir=out-" + prec, *sets)
        assert "| %s" % {"fp32": "fp32 |", "fp16": "fp16 (dynamic", "bf16": "bf16 |"}[prec] in p.stderr, p.stderr
        out[prec] = step_lines(os.path.join(d, "out-" + prec))
    return out


def check(out, what):
    for prec in out:
        if prec == "fp32":
            continue
        tol = TOL[prec]
        worst = {}
        for s, (h, f) in enumerate(zip(out[prec], out["fp32"])):
            assert not h.get("skipped"), (prec, s)
            for k in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                      "rewards/margins"):
                kind = k.split("/")[0]
                err = abs(h[k] - f[k]) / (abs(f[k]) if kind == "logps" else 1.0)
                worst[k] = max(worst.get(k, 0.0), err)
                assert err <= tol[kind], "%s %s step %d %s: %.6g vs fp32 %.6g" % (what, prec, s + 1, k, h[k], f[k])
        print("%s %s: worst %s" % (what, prec, {k: "%.2g" % v for k, v in worst.items()}))


def test_lora_dpo_half_precision_tracks_fp32(tmp_path):
    check(precision_runs(str(tmp_path), full=False), "lora")


def test_full_ft_dpo_half_precision_tracks_fp32(tmp_path):
    check(precision_runs(str(tmp_path), full=True), "full")

