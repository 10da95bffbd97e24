#!/usr/bin/env python3
"""ZeRO benchmark: per-rank peak memory (measured against `qtune plan`), step time and the share of the
gradient communication hidden behind the backward, at ZeRO stages 0, 1, 2 and 3, with 1, 2 and 4 ranks,
optimizer offload on and off, full fine-tuning or LoRA (--mode lora: r 8 on q_proj and v_proj; at stage 3 the
frozen base is what is partitioned, the adapter whole), on the bench-tiny and Qwen2.5-0.5B shapes. Stage 3 runs
with overlap_comm on and its parameter prefetch on and off (stage3_prefetch_bucket_size 5e7 / 0); a third
table sets it against stage 2 (overlap on) of the same shape, ranks and offload: step time and peak ratios,
and the exposed communication its gathers add.

Each case is one `qtune train` (under mpirun for several ranks) of --steps optimizer steps, micro-batch 1,
T tokens; the figures come from its metrics.jsonl (mem_peak_bytes_ranks, comm_busy_s, comm_wait_s,
elapsed_s) and from `qtune plan --json` (cpu_rank_bytes_per_rank). Step time is the median over the steps
after the first. Hidden share, stage 2 over several ranks with overlap_comm on: 1 - wait / busy of the
step's collectives, and (the second table) 1 - wait(on) / wait(off) against the same case with overlap_comm
off, where every reduction is waited for at once.

Usage (on a quiet machine; 4 ranks want 4 free cores x threads):
  /usr/bin/python3 bench/bench_zero.py --qtune build/src/cli/qtune \\
      [--shapes bench-tiny,qwen2.5-0.5b] [--ranks 1,2,4] [--stages 0,1,2] [--offload both|on|off]
      [--steps 4] [--seq-len 128] [--threads 1] [--precision fp32|fp16|bf16] [--mode full|lora]
      [--memory-only] [--bucket E] [--init-dtype f32|bf16] [--reuse-distance D] [--main-only]
      [--max-gib G] [--json OUT.json]
  /usr/bin/python3 bench/bench_zero.py --from-json OUT.json [--replan]    (the tables again)
--memory-only runs 2 steps per case (peaks, no timing claims)."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np

MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]
MIB = 2 ** 20


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def prepare(qtune, work, shape, T, steps, max_ranks, dtype="f32"):
    d = os.path.join(work, shape if dtype == "f32" else f"{shape}-{dtype}")
    if not os.path.exists(os.path.join(d, "model", "config.json")):
        os.makedirs(d, exist_ok=True)
        subprocess.run([qtune, "init", "--preset", shape, "--dtype", dtype, "--out", os.path.join(d, "model"),
                        "--force"], check=True, capture_output=True)
    V = json.load(open(os.path.join(d, "model", "config.json")))["vocab_size"]
    rng = np.random.default_rng(0)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for _ in range(steps * max_ranks + 4):
            f.write(json.dumps({"input_ids": [int(x) for x in rng.integers(1, V - 1, T + 1)]}) + "\n")
    return d


def plan_case(a, d, n, stage, offload, overlap):
    plan_args = [a.qtune, "plan", "--model", os.path.join(d, "model"), "--micro-batch", "1", "--seq-len",
                 str(a.seq_len), "--json", "--zero", str(stage), "--devices", str(n)]
    if a.precision != "fp32":
        plan_args += ["--precision", a.precision]
    if offload:
        plan_args += ["--offload", "cpu"]
    if overlap:
        plan_args += ["--overlap-comm"]
    if a.bucket:
        plan_args += ["--reduce-bucket-size", str(a.bucket), "--allgather-bucket-size", str(a.bucket)]
    if stage == 3 and a.reuse_distance is not None:
        plan_args += ["--max-reuse-distance", f"{a.reuse_distance:g}"]
    if a.mode == "lora":
        plan_args += ["--mode", "lora", "--lora-r", "8", "--lora-targets", "q_proj,v_proj"]
    return json.loads(subprocess.run(plan_args, capture_output=True, text=True, check=True).stdout)


def run_case(a, d, n, stage, offload, overlap, prefetch=True):
    name = f"n{n}_s{stage}_o{offload}_ov{int(overlap)}_pf{int(prefetch)}_{a.precision}" + \
        ("_lora" if a.mode == "lora" else "")
    z = {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}, "overlap_comm": overlap}
    if stage == 3 and not prefetch:
        z["stage3_prefetch_bucket_size"] = 0
    if stage == 3 and a.reuse_distance is not None:
        z["stage3_max_reuse_distance"] = a.reuse_distance
        name += f"_rd{a.reuse_distance:g}"
    if a.bucket:
        z.update(reduce_bucket_size=a.bucket, allgather_bucket_size=a.bucket)
    steps = 2 if a.memory_only else a.steps
    job = {"model": "model", "output_dir": name,
           "data": {"train": "train.jsonl", "seq_len": a.seq_len, "packing": False, "shuffle": False},
           "train": {"max_steps": steps, "log_steps": 1, "seed": 1, "save_steps": 0},
           "deepspeed": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                         "zero_optimization": z}}
    if a.precision != "fp32":
        job["deepspeed"][a.precision] = {"enabled": True}
    if a.mode == "lora":
        job["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    jp = os.path.join(d, name + ".json")
    json.dump(job, open(jp, "w"))
    shutil.rmtree(os.path.join(d, name), ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    cmd = ([shutil.which("mpirun"), *MPI_ARGS, "-np", str(n)] if n > 1 else []) + [a.qtune, "train", jp]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        log(p.stdout[-2000:] + p.stderr[-2000:])
        raise SystemExit(f"{name} failed")
    lines = [json.loads(l) for l in open(os.path.join(d, name, "metrics.jsonl")) if l.strip()]
    lines = [m for m in lines if "loss" in m]
    for x in os.listdir(os.path.join(d, name)):  # the last checkpoint and final/: 6.5 GB a case at 0.5B
        if x == "final" or x.startswith("checkpoint-"):
            shutil.rmtree(os.path.join(d, name, x), ignore_errors=True)
    peaks = lines[-1].get("mem_peak_bytes_ranks", [lines[-1]["mem_peak_bytes"]])
    plan = plan_case(a, d, n, stage, offload, overlap)
    times = [b["elapsed_s"] - x["elapsed_s"] for x, b in zip(lines, lines[1:])]
    busy = sum(m.get("comm_busy_s", 0) for m in lines[1:])
    wait = sum(m.get("comm_wait_s", 0) for m in lines[1:])
    return {"case": name, "ranks": n, "stage": stage, "offload": offload, "overlap": overlap, "prefetch": prefetch,
            "reuse_distance": a.reuse_distance if stage == 3 else None,
            "precision": a.precision, "mode": a.mode,
            "peak_mib": [x / MIB for x in peaks], "plan_mib": [x / MIB for x in plan["cpu_rank_bytes_per_rank"]],
            "step_s": statistics.median(times) if times else None, "comm_busy_s": busy, "comm_wait_s": wait,
            "hidden": (1 - wait / busy) if busy > 0 else None, "timed_steps": len(lines) - 1}


HEAD = ("| shape | ranks | stage | offload | overlap | plan MiB per rank | peak MiB per rank | worst err | "
        "step s | comm busy s | wait s | hidden |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def label(r):
    """overlap_comm, and at stage 3 the prefetch ("on+pf": the next layer's gather starts ahead)."""
    ov = "on" if r["overlap"] else "off"
    if r["stage"] != 3:
        return ov
    rd = r.get("reuse_distance")
    return ov + ("+pf" if r.get("prefetch", True) else "") + (f", reuse {rd:g}" if rd is not None else "")


def row(r, memory_only=False):
    """One case as a table row. `hidden` (1 - wait / busy) only where the gradient reductions can run during
    the backward: stage 2, several ranks, overlap_comm on. At stage 0/1 `qtune train` reduces after the
    backward, and busy there counts up to 4 buckets in flight at once, not time behind computation."""
    where = f"| {r['shape']}{' LoRA' if r.get('mode') == 'lora' else ''} | {r['ranks']} | {r['stage']} | {'cpu' if r['offload'] else 'none'} | " \
            f"{label(r)} |"
    if "skipped_plan_gib" in r:
        return f"{where} skipped: plans {r['skipped_plan_gib']:.1f} GiB over its ranks, more than this " \
               f"machine can give (--max-gib) | | | | | | |"
    err = max(abs(p - m) / m for p, m in zip(r["plan_mib"], r["peak_mib"]))
    f = lambda xs: " / ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    step = f"{r['step_s']:.2f}" if r["step_s"] is not None and not memory_only else "-"
    overlapped = r["stage"] >= 2 and r["ranks"] > 1 and r["overlap"]
    hid = f"{100 * r['hidden']:.0f}%" if overlapped and r["hidden"] is not None and not memory_only else "-"
    return f"{where} {f(r['plan_mib'])} | {f(r['peak_mib'])} | {100 * err:.1f}% | {step} | " \
           f"{r['comm_busy_s']:.3f} | {r['comm_wait_s']:.3f} | {hid} |"


def overlap_table(results):
    """Stage 2 over several ranks, overlap_comm on against off (the same reductions, all waited for):
    the communication the backward hid is 1 - wait(on) / wait(off)."""
    out = ["| shape | ranks | offload | s / step on | s / step off | wait s on | wait s off | "
           "hidden vs off | hidden (1 - wait/busy) |", "|---|---|---|---|---|---|---|---|---|"]
    ran = [r for r in results if "skipped_plan_gib" not in r and r["stage"] == 2 and r["ranks"] > 1]
    if not ran:
        return "\n".join(out)
    for on in (r for r in ran if r["overlap"]):
        off = [r for r in ran if not r["overlap"] and (r["shape"], r["ranks"], r["offload"]) ==
               (on["shape"], on["ranks"], on["offload"])]
        if not off or not off[0]["comm_wait_s"]:
            continue
        off = off[0]
        out.append(f"| {on['shape']} | {on['ranks']} | {'cpu' if on['offload'] else 'none'} | {on['step_s']:.2f} | "
                   f"{off['step_s']:.2f} | {on['comm_wait_s']:.3f} | {off['comm_wait_s']:.3f} | "
                   f"{100 * (1 - on['comm_wait_s'] / off['comm_wait_s']):.0f}% | "
                   f"{100 * on['hidden']:.0f}% |")
    return "\n".join(out)


def hidden_gathers(w2, w3pf, w3):
    """The share of the gathers' exposed time that prefetch hid: the wait stage 3 adds over stage 2 with
    prefetch against without (every gather waited for at once there)."""
    if w3 - w2 <= 0:
        return "-"
    return f"{100 * (1 - max(0.0, w3pf - w2) / (w3 - w2)):.0f}%"


def stage3_table(results):
    """Stage 3 against stage 2 (overlap_comm on) of the same shape, ranks and offload: the step time ratio, the
    worst rank's peak ratio, and the exposed communication (wait s a step) with the gathers' share of it: with
    prefetch (pf) and without."""
    out = ["| shape | ranks | offload | s / step stage 2 | stage 3 pf | stage 3 no pf | ratio pf | "
           "peak MiB stage 2 | stage 3 | peak ratio | wait s / step 2 | 3 pf | 3 no pf | gathers hidden |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ran = [r for r in results if "skipped_plan_gib" not in r and r["ranks"] > 1 and r["overlap"]]
    for s2 in (r for r in ran if r["stage"] == 2):
        key = (s2["shape"], s2["ranks"], s2["offload"])
        s3 = {r.get("prefetch", True): r for r in ran if r["stage"] == 3 and (r["shape"], r["ranks"], r["offload"]) == key}
        if True not in s3:
            continue
        pf, npf = s3[True], s3.get(False)  # --main-only: no prefetch-off case
        per = lambda r: r["comm_wait_s"] / max(1, r.get("timed_steps", 1))  # noqa: E731
        out.append(f"| {key[0]}{' LoRA' if s2.get('mode') == 'lora' else ''} | {key[1]} | {'cpu' if key[2] else 'none'} | {s2['step_s']:.2f} | "
                   f"{pf['step_s']:.2f} | {npf['step_s'] if npf else float('nan'):.2f} | "
                   f"{pf['step_s'] / s2['step_s']:.2f}x | "
                   f"{max(s2['peak_mib']):.0f} | {max(pf['peak_mib']):.0f} | "
                   f"{max(pf['peak_mib']) / max(s2['peak_mib']):.2f} | {per(s2):.3f} | {per(pf):.3f} | "
                   f"{per(npf) if npf else float('nan'):.3f} | "
                   f"{hidden_gathers(per(s2), per(pf), per(npf)) if npf else '-'} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qtune", default=os.environ.get("QTUNE_BIN", "build/src/cli/qtune"))
    ap.add_argument("--shapes", default="bench-tiny,qwen2.5-0.5b")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--offload", choices=("both", "on", "off"), default="both")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32")
    ap.add_argument("--mode", choices=("full", "lora"), default="full")
    ap.add_argument("--bucket", type=float, help="reduce_bucket_size and allgather_bucket_size (default 5e8)")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "qtune-bench-zero"))
    ap.add_argument("--init-dtype", choices=["f32", "bf16"], default="f32",
                    help="dtype of the weights file `qtune init` writes (bf16: half the mapped file, so the 0.5B "
                         "shape fits 4 ranks at stage 2 on a 24 GB machine)")
    ap.add_argument("--max-gib", type=float,
                    help="skip a case whose planned memory over all its ranks (cpu_rank_bytes_per_rank) exceeds "
                         "this many GiB: it would not fit this machine (listed as skipped)")
    ap.add_argument("--reuse-distance", type=float,
                    help="stage 3: zero_optimization.stage3_max_reuse_distance in its jobs and plans (default: "
                         "unset, DeepSpeed's 1e9); 0 frees the embedding/lm_head buffer after every use")
    ap.add_argument("--main-only", action="store_true",
                    help="stage 2 with overlap_comm on and stage 3 with prefetch only (the ratio table's columns; "
                         "no overlap table, no prefetch-off column)")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="print the tables of an earlier --json file and exit")
    ap.add_argument("--replan", action="store_true",
                    help="with --from-json: the plan column again from --qtune (same --work, --seq-len, --bucket)")
    a = ap.parse_args()
    a.qtune = os.path.abspath(a.qtune)
    ranks = [int(x) for x in a.ranks.split(",")]
    offs = {"both": [0, 1], "on": [1], "off": [0]}[a.offload]
    results = []
    if a.from_json:
        results = json.load(open(a.from_json))
        if a.replan:  # the plan column from this --qtune (a later build), the measurements as they were
            for r in results:
                if "skipped_plan_gib" not in r:
                    r["plan_mib"] = [x / MIB for x in plan_case(a, os.path.join(a.work, r["shape"]), r["ranks"],
                                                                 r["stage"], r["offload"],
                                                                 r["overlap"])["cpu_rank_bytes_per_rank"]]
        print(HEAD)
        for r in results:
            print(row(r))
        print()
        print(overlap_table(results))
        print()
        print(stage3_table(results))
        return
    print(HEAD, flush=True)
    for shape in a.shapes.split(","):
        d = prepare(a.qtune, a.work, shape, a.seq_len, a.steps, max(ranks), a.init_dtype)
        for n in ranks:
            for stage in [int(s) for s in a.stages.split(",")]:
                for off in offs:
                    if off and stage == 0:
                        continue
                    if stage == 3 and n == 1:
                        continue  # one rank has nothing to partition: stage 3 is stage 2 there
                    full = not a.memory_only and not a.main_only
                    overlaps = [True, False] if stage == 2 and n > 1 and full else [stage >= 2]
                    prefetches = [True, False] if stage == 3 and full else [True]
                    for ov, pf in [(o, f) for o in overlaps for f in prefetches]:
                        log(f"{shape}: {n} ranks, stage {stage}, offload {off}, overlap {ov}, prefetch {pf}")
                        if a.max_gib:
                            want = sum(plan_case(a, d, n, stage, off, ov)["cpu_rank_bytes_per_rank"]) / 2 ** 30
                            if want > a.max_gib:
                                results.append({"shape": shape, "ranks": n, "stage": stage, "offload": off,
                                                "overlap": ov, "prefetch": pf, "skipped_plan_gib": want})
                                print(row(results[-1]), flush=True)
                                continue
                        r = run_case(a, d, n, stage, off, ov, pf)
                        r["shape"] = shape
                        results.append(r)
                        print(row(r, a.memory_only), flush=True)
                        if a.json:  # as it goes, so an interrupted run keeps what it measured
                            json.dump(results, open(a.json, "w"), indent=1)
    if not a.memory_only:
        print()
        print(overlap_table(results))
        print()
        print(stage3_table(results))
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
