"""bf16 and 4-bit weights on the bf16 GEMM (issue 46 item 1, issue 39's CPU
targets): two qtune binaries (--before, --after) in alternating rounds on
the same model folders, medians over the rounds, the load average noted with
every figure. Three parts:

  prompt  `qtune generate --prompt-ids` (--prompt random ids, --max-new 1) on an
          f32 and a bf16 folder of the preset: prompt tokens / prefill_s.
          Target (AVX512_BF16): bf16 >= 1.7x qtune's own f32 prompt speed.
  lora    `qtune train`: LoRA r 8 on q/v, B 1 x T --seq, deepspeed bf16, on the
          bf16 folder and on it quantized on load (nf4); tokens/s median over
          the steps after --warmup. Target: the nf4 step within 1.3x the bf16 one.
  eval    `qtune eval` of --eval-rows rows of --seq random ids on the f32 and the bf16
          folder: tokens / wall seconds of the whole process (model load included).
  decode  `qtune generate --quantization nf4 --max-new N`: decode tokens/s
          against the bandwidth limit of the bytes a step reads (4-bit layer
          linears: packed codes + f32 absmax; the rest as stored; an untied
          embedding one row), STREAM triad (bench_gemm --triad) before and
          after each run. Target: >= 80% of that limit.

usage: /usr/bin/python3 bench/bench_bf16.py --before /work/base/build/src/cli/qtune \
           --after build/src/cli/qtune --build build --work /tmp/bf16bench [--preset qwen2.5-0.5b]
           [--threads 1] [--rounds 3] [--parts prompt,lora,eval,decode] [--json OUT]"""
import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def env(t):
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
    return e


def load():
    return round(os.getloadavg()[0], 1)


def ensure_model(qtune, work, preset, dt):
    d = os.path.join(work, "m-%s-%s" % (preset, dt))
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        subprocess.run([qtune, "init", "--preset", preset, "--dtype", dt, "--out", d, "--force"], check=True,
                       capture_output=True)
    return d


def prompt_ids(model, n):
    V = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    return [(7919 * i + 13) % (V - 1) + 1 for i in range(n)]


def generate(qtune, model, t, ids, new, extra=()):
    r = subprocess.run([qtune, "generate", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
                        "--max-new", str(new), "--temperature", "0", "--json", *extra], capture_output=True,
                       text=True, env=env(t))
    if r.returncode:
        sys.exit("qtune generate failed: " + r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def train(qtune, work, model, t, T, warmup, steps, quant):
    data = os.path.join(work, "data-T%d.jsonl" % T)
    if not os.path.exists(data):
        V = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        with open(data, "w") as f:
            for r in range(16):
                f.write(json.dumps({"input_ids": [(7919 * (i + 131 * r) + 13) % (V - 1) + 1 for i in range(T)]})
                        + "\n")
    out = os.path.join(work, "run")
    shutil.rmtree(out, ignore_errors=True)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0},
          "bf16": {"enabled": True}}
    job = {"model": model, "output_dir": out, "lora": LORA, "deepspeed": ds,
           "data": {"train": data, "format": "tokens", "seq_len": T, "packing": False, "shuffle": False},
           "train": {"max_steps": warmup + steps, "save_steps": 0, "log_steps": 1, "seed": 42, "resume": "never",
                     "overwrite_output_dir": True}}
    if quant:
        job["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": quant}
    jp = os.path.join(work, "job.json")
    json.dump(job, open(jp, "w"))
    r = subprocess.run([qtune, "train", jp], capture_output=True, text=True, env=env(t))
    if r.returncode:
        sys.exit("qtune train failed: " + r.stderr)
    st = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in x]
    shutil.rmtree(out, ignore_errors=True)
    return statistics.median(x["tokens_per_s"] for x in st[warmup:]), [x["loss"] for x in st]


def triad(build, t):
    r = subprocess.run([os.path.join(build, "bench", "bench_gemm"), "--triad", "--threads", str(t), "--reps", "3"],
                       capture_output=True, text=True, env=env(t))
    if r.returncode:
        sys.exit("bench_gemm --triad failed: " + r.stderr)
    return json.loads(r.stdout.splitlines()[0])["gbs"]


def nf4_bytes_per_token(model):
    """Bytes a decode step reads with the layer linears in 4 bits (no double quantization: f32 absmax per 64)."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    with open(os.path.join(model, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        nb = e["data_offsets"][1] - e["data_offsets"][0]
        if ".layers." in name and len(e["shape"]) == 2:
            numel = e["shape"][0] * e["shape"][1]
            nb = numel // 2 + (numel + 63) // 64 * 4
        elif name == "model.embed_tokens.weight" and not cfg.get("tie_word_embeddings", False):
            nb //= e["shape"][0]
        total += nb
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--build", default="build")
    ap.add_argument("--work", default="/tmp/bf16bench")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--eval-rows", type=int, default=2)
    ap.add_argument("--parts", default="prompt,lora,decode")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    bins = {"before": a.before, "after": a.after}
    parts = a.parts.split(",")
    t = a.threads
    res = {"threads": t, "preset": a.preset, "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                                          if l.startswith("model name")), "?")}
    m16 = ensure_model(a.after, a.work, a.preset, "bf16")
    if "prompt" in parts:
        m32 = ensure_model(a.after, a.work, a.preset, "f32")
        ids = prompt_ids(m16, a.prompt)
        runs = {}
        for r in range(a.rounds):
            for b in ("before", "after"):
                for dt, m in (("f32", m32), ("bf16", m16)):
                    o = generate(bins[b], m, t, ids, 1)
                    runs.setdefault("%s/%s" % (b, dt), []).append((a.prompt / o["prefill_s"], load()))
                    print("prompt round %d %s %s: %.1f tok/s (load %.1f)" % (r, b, dt, *runs["%s/%s" % (b, dt)][-1]),
                          flush=True)
        res["prompt"] = runs
    if "lora" in parts:
        runs = {}
        for r in range(a.rounds):
            for b in ("before", "after"):
                for q in ("", "nf4"):
                    tok, losses = train(bins[b], a.work, m16, t, a.seq, a.warmup, a.steps, q)
                    k = "%s/%s" % (b, q or "bf16")
                    runs.setdefault(k, []).append((tok, load(), losses))
                    print("lora round %d %s: %.2f tok/s (load %.1f) losses %s" % (r, k, tok, load(), losses), flush=True)
        res["lora"] = runs
    if "eval" in parts:
        m32 = ensure_model(a.after, a.work, a.preset, "f32")
        V = json.load(open(os.path.join(m16, "config.json")))["vocab_size"]
        data = os.path.join(a.work, "eval-%dx%d.jsonl" % (a.eval_rows, a.seq))
        with open(data, "w") as f:
            for r in range(a.eval_rows):
                f.write(json.dumps({"input_ids": [(7919 * (i + 131 * r) + 13) % (V - 1) + 1 for i in range(a.seq)]})
                        + "\n")
        runs = {}
        for r in range(a.rounds):
            for b in ("before", "after"):
                for dt, m in (("f32", m32), ("bf16", m16)):
                    t0 = time.time()
                    p = subprocess.run([bins[b], "eval", "--model", m, "--data", data, "--seq-len", str(a.seq)],
                                       capture_output=True, text=True, env=env(t))
                    if p.returncode:
                        sys.exit("qtune eval failed: " + p.stderr)
                    o = json.loads(p.stdout.strip().splitlines()[-1])
                    k = "%s/%s" % (b, dt)
                    runs.setdefault(k, []).append((a.eval_rows * a.seq / (time.time() - t0), load(), o["loss"]))
                    print("eval round %d %s: %.1f tok/s (load %.1f) loss %.6f" % (r, k, *runs[k][-1]), flush=True)
        res["eval"] = runs
    if "decode" in parts:
        bpt = nf4_bytes_per_token(m16)
        runs = {}
        ids = prompt_ids(m16, 16)
        for r in range(a.rounds):
            for b in ("before", "after"):
                g0 = triad(a.build, t)
                o = generate(bins[b], m16, t, ids, a.new, ("--quantization", "nf4"))
                g1 = triad(a.build, t)
                dec = o["decode_tokens_per_s"]
                pct = 100 * dec * bpt / 1e9 / ((g0 + g1) / 2)
                runs.setdefault(b, []).append((dec, pct, g0, g1, load()))
                print("decode round %d %s: %.2f tok/s, %.0f%% of triad %.1f/%.1f GB/s (%.2f GB/token, load %.1f)"
                      % (r, b, dec, pct, g0, g1, bpt / 1e9, load()), flush=True)
        res["decode"] = runs
        res["nf4_bytes_per_token"] = bpt
    print("\nmedians:")
    for part in ("prompt", "lora", "eval", "decode"):
        for k, v in res.get(part, {}).items():
            print("  %s %s: %.2f (rounds %s)" % (part, k, statistics.median(x[0] for x in v),
                                                ", ".join("%.2f" % x[0] for x in v)))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
