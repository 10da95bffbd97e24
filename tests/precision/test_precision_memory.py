"""Activation memory in fp16 (docs/precision.md "Memory"): saved activations
are stored in 2 bytes, so on a shape where activations dominate (12 layers,
micro-batch 4 x 256 tokens, LoRA on q,v, no checkpointing)
 - the plan's activations in fp16 are about half of fp32's: L layers in 2
   bytes plus one fp32 working layer (and the small fp32 rstd/lse), so the
   ratio is about 0.5 + 1/L (measured 0.589 at L = 12; 0.547 at L = 24 in
   tests/unit/precision);
 - the measured peak RSS (metrics.jsonl mem_peak_bytes) drops by what the
   plan says the activations save, within 10%, and each precision's plan is
   within 10% of its measured peak (as tests/tools/test_plan.py holds for fp32).
The base is an f16 file, so fp32 and fp16 hold the same base bytes (read from
the mapping in both) and the peaks differ only by the activations."""
import json
import os

import numpy as np
import pytest

from conftest import trainutil as tu

SHAPE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128,
         "intermediate_size": 352, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float16", "use_sliding_window": False}
B, T = 4, 256
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("precmem"))
    with open(os.path.join(d, "shape.json"), "w") as f:
        json.dump(SHAPE, f)
    tu.run("init", "--out", os.path.join(d, "m"), "--config", os.path.join(d, "shape.json"), "--seed", 1,
           "--dtype", "f16")
    rng = np.random.default_rng(0)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for _ in range(4 * B):
            f.write(json.dumps({"input_ids": [int(x) for x in rng.integers(1, 511, T + 1)]}) + "\n")
    out = {}
    for prec in ("fp32", "fp16"):
        ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1}
        if prec == "fp16":
            ds["fp16"] = {"enabled": True, "initial_scale_power": 12}
        job = tu.write_job(os.path.join(d, prec + ".json"), os.path.join(d, "m"), os.path.join(d, prec),
                           os.path.join(d, "train.jsonl"), T=T, lora=LORA,
                           train_opts={"max_steps": 2, "save_steps": 0}, ds=ds)
        os.environ["OMP_NUM_THREADS"] = "1"
        tu.run("train", job)
        with open(os.path.join(d, prec, "metrics.jsonl")) as f:
            peak = max(json.loads(l).get("mem_peak_bytes", 0) for l in f if l.strip())
        plan = json.loads(tu.run("plan", "--model", os.path.join(d, "m"), "--micro-batch", B, "--seq-len", T,
                                 "--precision", prec, "--mode", "lora", "--lora-r", LORA["r"], "--lora-targets",
                                 "q_proj,v_proj", "--json").stdout)
        out[prec] = (peak, plan)
    return out


def test_fp16_activations_about_half(runs):
    (p32, plan32), (p16, plan16) = runs["fp32"], runs["fp16"]
    a32, a16 = plan32["per_device_bytes"]["activations"], plan16["per_device_bytes"]["activations"]
    saved_plan, saved_measured = a32 - a16, p32 - p16
    print("plan activations: fp32 %.1f MiB, fp16 %.1f MiB (%.3f); measured peak RSS: fp32 %.1f MiB, fp16 %.1f MiB; "
          "saved: plan %.1f MiB, measured %.1f MiB; measured fp16 activations / fp32 %.3f"
          % (a32 / 2**20, a16 / 2**20, a16 / a32, p32 / 2**20, p16 / 2**20, saved_plan / 2**20,
             saved_measured / 2**20, (a32 - saved_measured) / a32))
    L = SHAPE["num_hidden_layers"]
    assert 0.5 < a16 / a32 < 0.5 + 1.2 / L
    assert abs(saved_measured - saved_plan) <= 0.10 * saved_plan
    assert (a32 - saved_measured) / a32 < 0.5 + 1.2 / L


@pytest.mark.parametrize("prec", ["fp32", "fp16"])
def test_plan_matches_measured_peak(runs, prec):
    peak, plan = runs[prec]
    err = (plan["cpu_rank_bytes"] - peak) / peak
    print("%s: plan %.1f MiB, measured peak %.1f MiB (%+.1f%%)" % (prec, plan["cpu_rank_bytes"] / 2**20,
                                                                 peak / 2**20, 100 * err))
    assert abs(err) <= 0.10
