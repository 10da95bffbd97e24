"""Where a qtune training step spends its GPU time: one step of the
qwen2.5-0.5b shape (random weights, B x T random ids) under Nsight Compute
(ncu --metrics gpu__time_duration.sum, clocks left as they are), the kernel
times summed by kernel name, printed as a markdown table with each name's
share of the summed time. ncu runs the kernels one at a time, so the sum is
GPU time without overlap; the step's wall time outside ncu is printed beside
it (the rest is host work and launch gaps).

usage: python3 bench/gpu_profile.py --qtune BIN --out DIR [--mode full|lora] [--precision bf16|fp16|fp32]
                                    [--B 4 --T 512] [--ncu PATH] [--top 25]"""
import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_speed as bs  # noqa: E402


def find_ncu(given):
    if given:
        return given
    p = shutil.which("ncu")
    if p:
        return p
    hits = sorted(glob.glob("/usr/local/cuda*/bin/ncu") + glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return hits[-1] if hits else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtune", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--mode", default="full")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--ncu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--backend", default="cuda", help="QTUNE_BACKEND for the runs (cpu or guard to rehearse)")
    a = ap.parse_args()
    ncu = find_ncu(a.ncu)
    os.makedirs(a.out, exist_ok=True)
    model, cfg = bs.ensure_model(a.qtune, a.out, a.shape)
    data = bs.ensure_data(a.out, cfg["vocab_size"], a.T, a.B * 3)
    env = dict(os.environ, QTUNE_BACKEND=a.backend)
    # the step's wall time without the profiler: 3 steps, the last one
    job, out = os.path.join(a.out, "job.json"), os.path.join(a.out, "run")
    bs.write_job(job, model, out, data, a.B, a.T, 3, a.mode, a.precision)
    subprocess.run([a.qtune, "train", job], check=True, capture_output=True, env=env)
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in x]
    wall = a.B * a.T / steps[-1]["tokens_per_s"]
    # the same 3 steps with every op timed (QTUNE_PROFILE, src/backend/profile.c), LoRA and full
    for mode in ("full", "lora"):
        bs.write_job(job, model, out, data, a.B, a.T, 3, mode, a.precision)
        r = subprocess.run([a.qtune, "train", job], capture_output=True, text=True, env=dict(env, QTUNE_PROFILE="1"))
        err = r.stderr.splitlines()
        at = next((i for i, x in enumerate(err) if "(QTUNE_PROFILE)" in x), None)
        print("%s %s %s, 3 steps of B %d x T %d with QTUNE_PROFILE=1 (exit %d):" % (a.shape, mode, a.precision, a.B,
                                                                                  a.T, r.returncode))
        print("```")
        print("\n".join(err[at:at + 40] if at is not None else err[-10:]))
        print("```")
        sys.stdout.flush()
    # one-token decoding: 64 greedy tokens, every op timed
    r = subprocess.run([a.qtune, "generate", "--model", model, "--prompt-ids", "5,17,99,3", "--max-new", "64",
                        "--temperature", "0"], capture_output=True, text=True, env=dict(env, QTUNE_PROFILE="1"))
    err = r.stderr.splitlines()
    at = next((i for i, x in enumerate(err) if "(QTUNE_PROFILE)" in x), None)
    print("%s generate, 64 greedy tokens, f32 weights, QTUNE_PROFILE=1 (exit %d):" % (a.shape, r.returncode))
    print("```")
    print("\n".join([x for x in err if "tok/s" in x] + (err[at:at + 25] if at is not None else err[-10:])))
    print("```")
    sys.stdout.flush()
    # one step under ncu
    if not ncu:
        print("no ncu here: no kernel table")
        return 0
    bs.write_job(job, model, out, data, a.B, a.T, 1, a.mode, a.precision)
    r = subprocess.run([ncu, "--target-processes", "all", "--clock-control", "none", "--metrics",
                        "gpu__time_duration.sum", "--csv",
                        "--page", "raw", "--print-units", "base", "--print-kernel-base", "function",
                        a.qtune, "train", job], capture_output=True, text=True, env=env)
    if r.returncode:
        print("ncu failed (%d): %s" % (r.returncode, r.stderr.strip()[-500:]))
        return 1
    with open(os.path.join(a.out, "..", "ncu-raw.txt"), "w") as f:  # kept for a parse that finds nothing
        f.write(r.stdout[:20000] + "\n...\n" + r.stdout[-5000:] + "\n---- stderr\n" + r.stderr[-5000:])
    lines = r.stdout.splitlines()
    head = next((i for i, x in enumerate(lines) if "Kernel Name" in x), None)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[head:])))) if head is not None else []
    col = next((c for c in (rows[0] if rows else {}) if "gpu__time_duration" in c), "gpu__time_duration.sum")
    tot, cnt = {}, {}
    for row in rows:
        try:
            ns = float(row[col].replace(",", ""))
        except (KeyError, ValueError):
            continue
        k = row.get("Kernel Name", "?")
        tot[k] = tot.get(k, 0.0) + ns
        cnt[k] = cnt.get(k, 0) + 1
    s = sum(tot.values())
    print("%s %s %s, B %d x T %d: step wall time %.1f ms without the profiler; %d kernels, %.1f ms of GPU time "
          "summed under ncu (includes the load's conversions and the one step)" % (
              a.shape, a.mode, a.precision, a.B, a.T, wall * 1e3, sum(cnt.values()), s / 1e6))
    print()
    print("| kernel | launches | ms | share |")
    print("|---|---|---|---|")
    for k in sorted(tot, key=tot.get, reverse=True)[: a.top]:
        print("| %s | %d | %.2f | %.1f%% |" % (k[:70], cnt[k], tot[k] / 1e6, 100 * tot[k] / s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
