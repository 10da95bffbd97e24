#!/usr/bin/env python3
"""Old qtune binary against new on generation: prompt processing (prompt tokens / prefill_s of a --prompt-ids
prompt, --max-new 1) and decode (decode tokens/s of --max-new new tokens after 8 prompt ids), greedy, on the given
model folders, at each thread count, in alternating rounds (which binary goes first alternates). Prints one line a
run with the 1-minute load average read just before it, then the medians and the median of the rounds' new/old
ratios. Greedy ids of old and new are compared too (a speed change must not move them in an f32 folder).

  /usr/bin/python3 bench/oldnew_decode.py --old OLD/qtune --new NEW/qtune --model f32=DIR --model bf16=DIR \\
      [--threads 1,2] [--rounds 3] [--prompt 128] [--new-tokens 64] [--json OUT.json]
"""
import argparse
import json
import os
import random
import statistics as S
import subprocess


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(exe, folder, t, part, ids, new):
    env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
    env.pop("QTUNE_LOG", None)
    ld = load()
    p = subprocess.run([exe, "generate", "--model", folder, "--prompt-ids", ",".join(map(str, ids)), "--max-new",
                        "1" if part == "prompt" else str(new), "--temperature", "0", "--json"],
                       capture_output=True, text=True, env=env, check=True)
    o = json.loads(p.stdout.strip().splitlines()[-1])
    speed = len(ids) / o["prefill_s"] if part == "prompt" else o["decode_tokens_per_s"]
    return speed, ld, o.get("ids") or o.get("output_ids") or o.get("tokens")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=FOLDER")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(0)
    res, rows = {}, []
    for r in range(a.rounds):
        for spec in a.model:
            name, folder = spec.split("=", 1)
            V = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
            for part in ("prompt", "decode"):
                ids = [rng.randrange(1, V - 1) for _ in range(a.prompt if part == "prompt" else 8)]
                for t in map(int, a.threads.split(",")):
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    got = {}
                    for which in order:
                        s, ld, out = run(a.old if which == "old" else a.new, folder, t, part, ids, a.new_tokens)
                        got[which] = (s, ld, out)
                        res.setdefault((part, name, t, which), []).append(s)
                        print(f"round {r} {part} {name} {t} thread(s) {which}: {s:.2f} tok/s (load {ld:.1f})",
                              flush=True)
                    same = got["old"][2] == got["new"][2] if got["old"][2] is not None else None
                    rows.append({"round": r, "part": part, "model": name, "threads": t,
                                 "old": got["old"][0], "new": got["new"][0], "load_old": got["old"][1],
                                 "load_new": got["new"][1], "same_ids": same})
    print("\n| part | model | threads | old tok/s by round | new tok/s by round | new / old (median of rounds) |")
    print("|---|---|---|---|---|---|")
    for (part, name, t, which) in sorted(k for k in res if k[3] == "old"):
        o, n = res[(part, name, t, "old")], res[(part, name, t, "new")]
        ratios = [x["new"] / x["old"] for x in rows if (x["part"], x["model"], x["threads"]) == (part, name, t)]
        print(f"| {part} | {name} | {t} | {', '.join(f'{x:.1f}' for x in o)} | {', '.join(f'{x:.1f}' for x in n)} "
              f"| {S.median(ratios):.2f} |")
    diff = [x for x in rows if x["same_ids"] is False]
    print(f"\ngreedy ids: {len(diff)} of {len(rows)} runs differ between old and new" if rows and
          rows[0]["same_ids"] is not None else "\ngreedy ids: not in this binary's --json")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
