"""Decode speed of `qtune generate` against the memory-bandwidth limit.

A one-token decode step reads every weight matrix once (the lm_head, which is
the embedding when tied, included; the embedding of an untied model only one
row), so its floor is bytes_per_token / bandwidth. For each weight dtype and
thread count this runs greedy generation on a random model of the preset's
shape (`qtune init --preset P --dtype D`), takes the median decode tokens/s
over the reps (qtune's own `decode_tokens_per_s`: one-position decode calls,
sampling included), and measures STREAM's triad (bench_gemm --triad) at the
same thread count before the first run and after each one, in the same run:
the limit is triad GB/s / bytes per token, and the table gives qtune's % of
it twice: the median run against the first and last triad, and each run
against the two triads around it (their median, then every run's figure).

The host's bandwidth moves within seconds (the 2-thread triad read 41-76
GB/s within one minute, session 16), faster than triads run between
generate processes can follow. So each rep also runs bench_decode_steps
(bench/bench_decode_steps.c): --new one-token steps of the same model in
one process, each between two single triad passes, every step's read rate
against the mean of its two passes; the last column is the median of the
reps' medians (then each rep's). It is the stricter figure where the host
is quiet, when the triad reads more than the decode step can.

With --batches 1,4,8 it also runs `qtune generate --prompts FILE --batch N`
with N prompts of the same length decoding together and reports the
aggregate decode tokens/s (every sequence's tokens per second of the steps,
from generate's closing stderr line), the steps/s, and the steps' % of the
one-token limit (a step reads the weights once for all N rows).

usage (on a quiet machine; the 0.5B shape takes a few minutes):
  /usr/bin/python3 bench/bench_decode.py --build build --preset qwen2.5-0.5b \
      --dtypes f32,bf16 --threads 1,2 --new 64 --reps 3 --batches 1,4,8 --json bench/runs/decode.json
A quick check of the script itself: --preset bench-tiny --new 8 --reps 1.
"""
import re
import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time


def env(t):
    e = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
    e.pop("QTUNE_LOG", None)
    return e


def triad(build, t, reps=3):
    r = subprocess.run([os.path.join(build, "bench", "bench_gemm"), "--triad", "--threads", str(t), "--reps",
                        str(reps)], capture_output=True, text=True, env=env(t))
    if r.returncode:
        sys.exit("bench_gemm --triad failed: " + r.stderr)
    return json.loads(r.stdout.splitlines()[0])["gbs"]


def bytes_per_token(model):
    """Bytes of weights one decode step reads: every tensor in its stored dtype, except an untied model's
    embedding table, of which one row is read."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    with open(os.path.join(model, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        nb = e["data_offsets"][1] - e["data_offsets"][0]
        if name == "model.embed_tokens.weight" and not cfg.get("tie_word_embeddings", False):
            nb //= e["shape"][0]
        total += nb
    return total


def run_generate(qtune, model, t, prompt, new):
    r = subprocess.run([qtune, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new", str(new), "--temperature", "0", "--json"], capture_output=True, text=True,
                       env=env(t))
    if r.returncode:
        sys.exit("qtune generate failed: " + r.stderr)
    o = json.loads(r.stdout.strip().splitlines()[-1])
    return o["decode_tokens_per_s"], len(o["prompt_ids"]) / o["prefill_s"], o["ids"]


def run_steps(build, model, t, bpt, new, prompt_len):
    """bench_decode_steps: the median over the steps of each step's read rate against the triad passes around it
    (percent)."""
    r = subprocess.run([os.path.join(build, "bench", "bench_decode_steps"), "--model", model, "--bytes", str(bpt),
                        "--steps", str(new), "--prompt", str(prompt_len)], capture_output=True, text=True,
                       env=env(t))
    if r.returncode:
        sys.exit("bench_decode_steps failed: " + r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])["pct_of_triad_median"]


def run_batch(qtune, model, t, prompts, new, path):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    r = subprocess.run([qtune, "generate", "--model", model, "--prompts", path, "--batch", str(len(prompts)),
                        "--max-new", str(new), "--temperature", "0", "--json"], capture_output=True, text=True,
                       env=env(t))
    if r.returncode:
        sys.exit("qtune generate --batch failed: " + r.stderr)
    m = re.search(r"decode (\d+) tokens, ([0-9.]+) tok/s", r.stderr)
    if not m:
        sys.exit("no aggregate decode line in generate's stderr: " + r.stderr)
    return float(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--qtune", default=None, help="qtune binary (default BUILD/src/cli/qtune)")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the random models go (default /tmp/qtune-bench-decode)")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--batches", default="", help="also --prompts/--batch runs with these N (e.g. 1,4,8)")
    a = ap.parse_args()
    qtune = a.qtune or os.path.join(a.build, "src", "cli", "qtune")
    work = a.workdir or "/tmp/qtune-bench-decode"
    os.makedirs(work, exist_ok=True)
    rng = random.Random(7)
    rows, brows = [], []
    for dt in a.dtypes.split(","):
        model = os.path.join(work, "%s-%s" % (a.preset, dt))
        if not os.path.exists(os.path.join(model, "model.safetensors")):
            t0 = time.time()
            subprocess.run([qtune, "init", "--out", model, "--preset", a.preset, "--dtype", dt, "--seed", "1"],
                           check=True, capture_output=True)
            print("made %s in %.0f s" % (model, time.time() - t0), file=sys.stderr)
        bpt = bytes_per_token(model)
        vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        prompt = [rng.randrange(vocab) for _ in range(a.prompt_len)]
        run_generate(qtune, model, 1, prompt, 2)  # page the weights in before timing
        for t in map(int, a.threads.split(",")):
            triads = [triad(a.build, t)]  # one before the runs and one after each: every run is bracketed
            dec, pre, steps = [], [], []
            for _ in range(a.reps):
                d, p, ids = run_generate(qtune, model, t, prompt, a.new)
                dec.append(d)
                pre.append(p)
                triads.append(triad(a.build, t))
                steps.append(run_steps(a.build, model, t, bpt, a.new, a.prompt_len))
            before, after = triads[0], triads[-1]
            gbs = (before + after) / 2
            limit = gbs * 1e9 / bpt
            med = statistics.median(dec)
            # each run against the mean of the two triads around it (the machine's bandwidth moves by 2x within
            # minutes; the runs' own neighbours follow it more closely than the first and last triad do)
            paired = [100 * d * bpt / 1e9 / ((triads[k] + triads[k + 1]) / 2) for k, d in enumerate(dec)]
            row = {"preset": a.preset, "dtype": dt, "threads": t, "decode_tok_s": med, "decode_all": dec,
                   "prefill_tok_s": statistics.median(pre), "bytes_per_token": bpt, "triad_gbs_before": before,
                   "triad_gbs_after": after, "triad_gbs_all": triads, "limit_tok_s": limit,
                   "pct_of_limit": 100 * med / limit, "pct_of_limit_paired": paired,
                   "pct_of_limit_paired_median": statistics.median(paired), "pct_of_step_triads": steps,
                   "pct_of_step_triads_median": statistics.median(steps)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            for n in [int(b) for b in a.batches.split(",") if b]:
                prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(n)]
                agg = [run_batch(qtune, model, t, prompts, a.new, os.path.join(work, "prompts.jsonl"))
                       for _ in range(a.reps)]
                med = statistics.median(agg)
                brow = {"preset": a.preset, "dtype": dt, "threads": t, "batch": n, "decode_tok_s": med,
                        "decode_all": agg, "steps_per_s": med / n, "limit_tok_s": limit,
                        "pct_of_limit_per_step": 100 * med / n / limit}
                brows.append(brow)
                print(json.dumps(brow), file=sys.stderr)
    print("| %s decode | threads | tok/s (median of %d) | bytes/token | triad GB/s first / last | limit tok/s | "
          "%% of limit | each run against its own triads (median; all) | each step against the triad passes "
          "around it (median of reps; each rep's median) |" % (a.preset, a.reps))
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %.1f | %.2f GB | %.1f / %.1f | %.1f | %.0f%% | %.0f%% (%s) | %.0f%% (%s) |" % (
            r["dtype"], r["threads"], r["decode_tok_s"], r["bytes_per_token"] / 1e9, r["triad_gbs_before"],
            r["triad_gbs_after"], r["limit_tok_s"], r["pct_of_limit"], r["pct_of_limit_paired_median"],
            ", ".join("%.0f" % x for x in r["pct_of_limit_paired"]), r["pct_of_step_triads_median"],
            ", ".join("%.0f" % x for x in r["pct_of_step_triads"])))
    if brows:
        print()
        print("| %s --batch N | threads | N | aggregate decode tok/s (median of %d) | steps/s | "
              "step %% of the one-token limit |" % (a.preset, a.reps))
        print("|---|---|---|---|---|---|")
        for r in brows:
            print("| %s | %d | %d | %.1f | %.1f | %.0f%% |" % (r["dtype"], r["threads"], r["batch"], r["decode_tok_s"],
                                                            r["steps_per_s"], r["pct_of_limit_per_step"]))
    if a.json:
        json.dump({"rows": rows, "batch_rows": brows, "new": a.new, "prompt_len": a.prompt_len,
                   "load": os.getloadavg()}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
