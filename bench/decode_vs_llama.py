#!/usr/bin/env python3
"""Prompt processing and decode speed, qtune against llama.cpp on the same model, in alternating rounds, f32 and
bf16, 1 and 2 threads. llama.cpp is not part of the build: point --llama-bench at a CPU build of it. The GGUF files
are `qtune export --gguf` of the same folders (bench_decode.py makes the folders; they need a tokenizer.json for the
export).

  prompt  `qtune generate --prompt-ids` (--prompt random ids, --max-new 1, --json): prompt tokens / prefill_s, the
          one batched forward of the prompt and the last row's logits; against `llama-bench -p N -n 0 -r 1 -mmp 0`
          (ppN: one llama_decode of N tokens, logits of the last one). The same work; llama-bench runs a warm-up
          decode first and qtune's figure is the first forward of a fresh process (cold caches, first touch of its
          buffers), so a difference of a few percent at this size favours llama.cpp.
  decode  `qtune generate` (decode tokens/s of 64 new tokens after 8 prompt ids) against
          `llama-bench -p 0 -n 64 -r 1 -mmp 0` (tg64).
Both llama-bench runs read the weights into memory as qtune copies them (-mmp 0, or -lm none where llama-bench has
--load-mode), not from the default file mapping.
Which program goes first alternates from round to round. Every figure is printed with the 1-minute load average
read just before it ran: on a shared machine the ratios of alternating rounds mean more than the absolute figures.

  /usr/bin/python3 bench/decode_vs_llama.py --qtune build/src/cli/qtune \\
      --llama-bench /work/llama.cpp/build/bin/llama-bench \\
      --model f32=/tmp/qtune-bench-decode/qwen2.5-0.5b-f32,/tmp/qwen05-f32.gguf \\
      --model bf16=/tmp/qtune-bench-decode/qwen2.5-0.5b-bf16,/tmp/qwen05-bf16.gguf \\
      --parts prompt,decode --prompt 128 --rounds 3 [--json OUT.json]
"""
import argparse
import json
import os
import random
import statistics as S
import subprocess


def env(t):
    e = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
    e.pop("QTUNE_LOG", None)
    return e


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def qtune_run(a, folder, t, part, ids):
    """(tokens/s, load): prompt tokens / prefill_s for part prompt, decode tokens/s for decode."""
    ld = load()
    new = "1" if part == "prompt" else "64"
    p = subprocess.run([a.qtune, "generate", "--model", folder, "--prompt-ids", ",".join(map(str, ids)),
                        "--max-new", new, "--temperature", "0", "--json"], capture_output=True, text=True,
                       env=env(t), check=True)
    o = json.loads(p.stdout.strip().splitlines()[-1])
    return (len(ids) / o["prefill_s"] if part == "prompt" else o["decode_tokens_per_s"]), ld


def no_mmap(exe):
    """llama-bench's option that reads the weights into memory: `-mmp 0` until its `--load-mode` (de3ff81 has
    only the latter, `-lm none`)."""
    h = subprocess.run([exe, "--help"], capture_output=True, text=True)
    return ["-lm", "none"] if "--load-mode" in h.stdout + h.stderr else ["-mmp", "0"]


def llama_run(a, gguf, t, part):
    ld = load()
    pn = ["-p", str(a.prompt), "-n", "0"] if part == "prompt" else ["-p", "0", "-n", "64"]
    p = subprocess.run([a.llama_bench, "-m", gguf, *pn, "-t", str(t), "-r", "1", "-o", "json", *a.no_mmap],
                       capture_output=True, text=True, env=env(t), check=True)
    o = json.loads(p.stdout)[0]
    return o["avg_ts"], ld, o.get("build_commit"), o.get("cpu_info")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtune", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=QTUNE_FOLDER,GGUF_FILE")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="prompt,decode")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the prompt part (llama-bench -p)")
    ap.add_argument("--json", help="also write every figure here")
    a = ap.parse_args()
    a.no_mmap = no_mmap(a.llama_bench)
    models = [(m.split("=", 1)[0], *m.split("=", 1)[1].split(",")) for m in a.model]
    parts = a.parts.split(",")
    for p in parts:
        if p not in ("prompt", "decode"):
            raise SystemExit("--parts: %r is not a part; use prompt, decode or both (comma-separated)" % p)
    vocab = json.load(open(os.path.join(models[0][1], "config.json")))["vocab_size"]
    rng = random.Random(7)
    ids = {"prompt": [rng.randrange(vocab) for _ in range(a.prompt)], "decode": list(range(1, 9))}
    res, build = {}, None
    for r in range(a.rounds):
        for part in parts:
            for name, folder, gguf in models:
                for t in map(int, a.threads.split(",")):
                    if r % 2 == 0:
                        q, ql = qtune_run(a, folder, t, part, ids[part])
                        lt, ll, build, cpu = llama_run(a, gguf, t, part)
                    else:
                        lt, ll, build, cpu = llama_run(a, gguf, t, part)
                        q, ql = qtune_run(a, folder, t, part, ids[part])
                    res.setdefault((part, name, t), []).append((q, lt, ql, ll))
                    print("round %d %s %s %d thread(s): qtune %.1f tok/s (load %.1f), llama.cpp %.1f (load %.1f)" % (
                        r, part, name, t, q, ql, lt, ll), flush=True)
    print("\nllama.cpp build %s\n" % build)
    print("| part | model | threads | qtune tok/s (load) by round | llama.cpp tok/s (load) by round | medians "
          "qtune / llama.cpp | qtune / llama.cpp (median of rounds' ratios) | qtune ahead |")
    print("|---|---|---|---|---|---|---|---|")
    for (part, name, t), v in sorted(res.items()):
        print("| %s | %s | %d | %s | %s | %.1f / %.1f | %.2f | %d of %d |" % (
            part, name, t, ", ".join("%.1f (%.1f)" % (x[0], x[2]) for x in v),
            ", ".join("%.1f (%.1f)" % (x[1], x[3]) for x in v), S.median([x[0] for x in v]),
            S.median([x[1] for x in v]), S.median([x[0] / x[1] for x in v]), sum(x[0] > x[1] for x in v), len(v)))
    names = [m[0] for m in models]
    if "prompt" in parts and "f32" in names and "bf16" in names:
        print("\nqtune's own bf16 / f32 prompt speed (per round): " + "; ".join(
            "%d thread(s) %s" % (t, ", ".join("%.2f" % (b[0] / f[0]) for b, f in zip(
                res[("prompt", "bf16", t)], res[("prompt", "f32", t)]))) for t in map(int, a.threads.split(","))))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"llama_build": build, "prompt": a.prompt, "rounds": [
                {"part": p, "model": n, "threads": t, "qtune": [x[0] for x in v], "llama": [x[1] for x in v],
                 "qtune_load": [x[2] for x in v], "llama_load": [x[3] for x in v]} for (p, n, t), v in res.items()]},
                f, indent=1)


if __name__ == "__main__":
    main()
