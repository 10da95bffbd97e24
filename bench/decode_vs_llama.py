#!/usr/bin/env python3
"""Decode speed, qtune against llama.cpp on the same model, in alternating rounds: `qtune generate` (decode
tokens/s of 64 new tokens after 8 prompt ids, --json) and `llama-bench -p 0 -n 64 -r 1 -mmp 0` (tg64; weights
read into memory as qtune copies them, not from llama.cpp's default file mapping), f32 and bf16, 1 and 2
threads. llama.cpp is not part of the build: point --llama-bench at a CPU build of it. The GGUF files are
`qtune export --gguf` of the same folders (bench_decode.py makes the folders; they need a tokenizer.json
for the export).

  /usr/bin/python3 bench/decode_vs_llama.py --qtune build/src/cli/qtune \\
      --llama-bench /work/llama.cpp/build/bin/llama-bench \\
      --model f32=/tmp/qtune-bench-decode/qwen2.5-0.5b-f32,/tmp/qwen05-f32.gguf \\
      --model bf16=/tmp/qtune-bench-decode/qwen2.5-0.5b-bf16,/tmp/qwen05-bf16.gguf --rounds 3
"""
import argparse
import json
import os
import statistics as S
import subprocess


def env(t):
    e = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
    e.pop("QTUNE_LOG", None)
    return e


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtune", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=QTUNE_FOLDER,GGUF_FILE")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    models = [(m.split("=", 1)[0], *m.split("=", 1)[1].split(",")) for m in a.model]
    res = {}
    for r in range(a.rounds):
        for name, folder, gguf in models:
            for t in map(int, a.threads.split(",")):
                p = subprocess.run([a.qtune, "generate", "--model", folder, "--prompt-ids", "1,2,3,4,5,6,7,8",
                                    "--max-new", "64", "--temperature", "0", "--json"], capture_output=True,
                                   text=True, env=env(t), check=True)
                q = json.loads(p.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]
                p = subprocess.run([a.llama_bench, "-m", gguf, "-p", "0", "-n", "64", "-t", str(t), "-r", "1",
                                    "-o", "json", "-mmp", "0"], capture_output=True, text=True, env=env(t), check=True)
                lt = json.loads(p.stdout)[0]["avg_ts"]
                res.setdefault((name, t), []).append((q, lt))
                print(f"round {r} {name} {t} thread(s): qtune {q:.1f} tok/s, llama.cpp {lt:.1f}", flush=True)
    print("| model | threads | qtune (rounds) | llama.cpp (rounds) | medians | qtune ahead |")
    print("|---|---|---|---|---|---|")
    for (name, t), v in sorted(res.items()):
        print("| %s | %d | %s | %s | %.1f / %.1f | %d of %d |" % (
            name, t, ", ".join("%.1f" % x for x, _ in v), ", ".join("%.1f" % y for _, y in v),
            S.median([x for x, _ in v]), S.median([y for _, y in v]), sum(x > y for x, y in v), len(v)))


if __name__ == "__main__":
    main()
