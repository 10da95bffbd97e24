"""Model benchmark: qtune against the PyTorch reference (tests/ref/qwen2_ref.py)
on the qwen2.5-0.5b shape with random weights stored in bf16, B=1, T=256.

Measures, in one run on this machine:
  - peak RSS of `qtune eval` (one 256-token example) from /usr/bin/time -v
  - forward ms per token: qtune (qtune_ref_driver --mode eval) vs reference (fp32, no_grad)
  - ms per training step (forward + backward): full fine-tuning and LoRA
    (r=8, q_proj+v_proj) vs the reference with torch autograd (fp32)
Threads: OMP_NUM_THREADS / torch.set_num_threads from --threads (default 2).

usage: /usr/bin/python3 bench/bench_model.py BUILD_DIR [--threads N] [--out bench/RESULTS-model.md]"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ref"))
import st  # noqa: E402
from qwen2_ref import Qwen2Ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "qtune-bench-qwen2.5-0.5b-bf16"))
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS-model.md"))
    a = ap.parse_args()
    qtune = os.path.join(a.build, "src", "cli", "qtune")
    driver = os.path.join(a.build, "tests", "unit", "model", "qtune_ref_driver")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    torch.set_num_threads(a.threads)
    if not os.path.exists(os.path.join(a.model, "model.safetensors")):
        subprocess.run([qtune, "init", "--out", a.model, "--preset", "qwen2.5-0.5b", "--dtype", "bf16", "--force"],
                       check=True, env=env)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    V, T = cfg["vocab_size"], a.T
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, T).tolist()
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "eval.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"input_ids": ids}) + "\n")
    res = {}

    cmd = ["/usr/bin/time", "-v", qtune, "eval", "--model", a.model, "--data", data, "--seq-len", str(T)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    res["eval_wall_s"] = time.time() - t0
    assert r.returncode == 0, r.stderr
    res["eval_peak_rss_mib"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    res["eval_line"] = r.stdout.strip().splitlines()[-1]

    batch = {"B": 1, "T": T, "inputs": ids, "targets": ids[1:] + [-100], "positions": list(range(T)),
             "doc_start": [0] * T}
    bp = os.path.join(tmp, "batch.json")
    json.dump(batch, open(bp, "w"))

    def drive(*opts):
        out = os.path.join(tmp, "out.safetensors")
        r = subprocess.run([driver, a.model, bp, out, "--steps", str(a.steps), *opts], capture_output=True,
                           text=True, env=env)
        assert r.returncode == 0, r.stderr
        return st.read(out)["step_ms"]

    res["qtune_fwd_ms"] = float(drive("--mode", "eval")[1:].mean() if a.steps > 1 else drive("--mode", "eval")[0])
    res["qtune_lora_step_ms"] = float(np.mean(drive("--mode", "train", "--lora", "8", "16", "q_proj,v_proj")[1:]))
    res["qtune_full_step_ms"] = float(np.mean(drive("--mode", "train")[1:]))

    # the reference, fp32
    x = np.array([ids])
    tg = np.array([ids[1:] + [-100]])
    ref = Qwen2Ref(a.model, dtype=torch.float32)
    times = []
    with torch.no_grad():
        for _ in range(a.steps):
            t0 = time.time()
            ref.loss(x, tg)
            times.append(time.time() - t0)
    res["ref_fwd_ms"] = 1e3 * float(np.mean(times[1:] if len(times) > 1 else times))
    times = []
    for _ in range(a.steps):
        for p in ref.p.values():
            p.grad = None
        t0 = time.time()
        loss, _, _ = ref.loss(x, tg)
        loss.backward()
        times.append(time.time() - t0)
    res["ref_full_step_ms"] = 1e3 * float(np.mean(times[1:] if len(times) > 1 else times))
    for p in ref.p.values():
        p.grad = None
        p.requires_grad_(False)
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = C // H
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for name, o in (("q_proj", H * D), ("v_proj", KV * D)):
            k = "base_model.model.model.layers.%d.self_attn.%s" % (l, name)
            w[k + ".lora_A.weight"] = rng.uniform(-1, 1, (8, C)).astype(np.float32) / np.sqrt(C)
            w[k + ".lora_B.weight"] = np.zeros((o, 8), np.float32)
    lref = Qwen2Ref.__new__(Qwen2Ref)
    lref.__dict__.update(ref.__dict__)
    lref.lora = {"r": 8, "alpha": 16}
    lref.scaling = 2.0
    lref.lp = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    times = []
    for _ in range(a.steps):
        t0 = time.time()
        loss, _, _ = lref.loss(x, tg)
        loss.backward()
        times.append(time.time() - t0)
    res["ref_lora_step_ms"] = 1e3 * float(np.mean(times[1:] if len(times) > 1 else times))

    lines = [
        "# Model benchmark (qwen2.5-0.5b shape, random weights stored in bf16, B=1, T=%d)" % T,
        "",
        "Measured by `bench/bench_model.py` on the shared 2-core development machine, %d threads for both"
        % a.threads,
        "(other engineers' jobs were running at the same time, so the numbers are noisy). Every timing is",
        "the mean over runs after the first (warm-up), %d runs each." % a.steps,
        "",
        "Command: `/usr/bin/python3 bench/bench_model.py build-model --threads %d --steps %d`" % (a.threads, a.steps),
        "",
        "| measure | qtune | PyTorch reference (fp32) |",
        "|---|---|---|",
        "| peak RSS of `qtune eval --seq-len %d` (one example) | %.0f MiB | |" % (T, res["eval_peak_rss_mib"]),
        "| forward, ms per token | %.2f | %.2f |" % (res["qtune_fwd_ms"] / T, res["ref_fwd_ms"] / T),
        "| forward, ms per %d-token row | %.0f | %.0f |" % (T, res["qtune_fwd_ms"], res["ref_fwd_ms"]),
        "| training step (fwd+bwd), LoRA r=8 q,v, ms | %.0f | %.0f |" % (res["qtune_lora_step_ms"],
                                                                     res["ref_lora_step_ms"]),
        "| training step (fwd+bwd), full fine-tuning, ms | %.0f | %.0f |" % (res["qtune_full_step_ms"],
                                                                          res["ref_full_step_ms"]),
        "",
        "qtune eval's last line: `%s` (wall %.1f s including loading)." % (res["eval_line"], res["eval_wall_s"]),
        "qtune's base stays bf16 in the mapping for eval and LoRA (converted to f32 panels per matmul);",
        "full fine-tuning widens it to an fp32 master block with fp32 gradients. The reference holds fp32",
        "copies of all weights.",
        "",
    ]
    open(a.out, "w").write("\n".join(lines))
    print("\n".join(lines))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
