#!/usr/bin/python3
"""Mixed-precision figures for bench/RESULTS-precision.md: the same small job
trained in fp32, fp16 and bf16 (emulated where the CPU lacks AVX512_BF16),
LoRA and full fine-tuning; prints a markdown table of tokens/s (median over
the steps after the first two) and peak RSS (metrics.jsonl mem_peak_bytes),
plus the model's own allocation for the run (qtune plan is not used: this is
what the CPU process holds).

usage: bench/bench_precision.py QTUNE_BIN WORKDIR [--steps N] [--threads T]"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np

SHAPE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 512,
         "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
         "tie_word_embeddings": True, "torch_dtype": "float32", "hidden_act": "silu"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("qtune")
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), QTUNE_BF16_EMULATE="1")
    env.pop("QTUNE_LOG", None)
    model = os.path.join(a.work, "model")
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        cfgp = os.path.join(a.work, "shape.json")
        with open(cfgp, "w") as f:
            json.dump(SHAPE, f)
        subprocess.run([a.qtune, "init", "--out", model, "--config", cfgp, "--seed", "1"], check=True, env=env)
    data = os.path.join(a.work, "train.jsonl")
    rng = np.random.default_rng(0)
    with open(data, "w") as f:
        for _ in range(256):
            f.write(json.dumps({"input_ids": rng.integers(1, 4096, 256).tolist()}) + "\n")
    rows = []
    for mode in ("lora", "full"):
        for prec in ("fp32", "fp16", "bf16"):
            out = os.path.join(a.work, "%s-%s" % (mode, prec))
            shutil.rmtree(out, ignore_errors=True)
            ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
            if prec != "fp32":
                ds[prec] = {"enabled": True}
            job = {"model": model, "output_dir": out,
                   "data": {"train": data, "seq_len": 256, "packing": False, "shuffle": False},
                   "train": {"max_steps": a.steps, "save_steps": 0, "log_steps": 1, "seed": 1}, "deepspeed": ds}
            if mode == "lora":
                job["lora"] = {"r": 8, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
            jp = out + ".json"
            with open(jp, "w") as f:
                json.dump(job, f)
            r = subprocess.run([a.qtune, "train", jp], capture_output=True, text=True, env=env)
            if r.returncode:
                sys.exit("%s %s failed:\n%s" % (mode, prec, r.stderr))
            lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
            tps = statistics.median(m["tokens_per_s"] for m in lines[2:])
            peak = max(m["mem_peak_bytes"] for m in lines)
            rows.append((mode, prec, tps, peak, lines[-1]["loss"]))
            print("%s %s: %.0f tokens/s, peak RSS %.1f MiB" % (mode, prec, tps, peak / 2 ** 20), file=sys.stderr)
    print("| mode | precision | tokens/s (median) | peak RSS (MiB) | loss at step %d |" % a.steps)
    print("|---|---|---|---|---|")
    for mode, prec, tps, peak, loss in rows:
        print("| %s | %s | %.0f | %.1f | %.4f |" % (mode, prec + (" (emulated)" if prec == "bf16" else ""), tps,
                                                   peak / 2 ** 20, loss))


if __name__ == "__main__":
    main()
