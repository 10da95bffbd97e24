"""Alternating qtune generate / llama-bench decode tok/s, f32 and bf16, 1 and 2 threads, on models
/tmp/s15/mt-{f32,bf16} (qtune init --seed 1 --tokenizer ...) and their GGUF exports /tmp/s15/m_{f32,bf16}.gguf.
  /usr/bin/python3 bench/probes/vs_llama.py ROUNDS QTUNE_BIN   (bench/RESULTS-decode.md, session 15)"""
import json, subprocess, sys, os, random
R, Q = int(sys.argv[1]), sys.argv[2]
LB = "/work/llama.cpp/build/bin/llama-bench"
random.seed(5); prompt = ",".join(str(random.randrange(1000, 50000)) for _ in range(16))
rows = []
for r in range(R):
    for d in ("f32", "bf16"):
        for t in (1, 2):
            env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS="1")
            o = subprocess.run([Q, "generate", "--model", f"/tmp/s15/mt-{d}", "--prompt-ids", prompt, "--max-new", "64", "--temperature", "0", "--json"], capture_output=True, text=True, env=env)
            q = json.loads(o.stdout)["decode_tokens_per_s"]
            o = subprocess.run([LB, "-m", f"/tmp/s15/m_{d}.gguf", "-p", "0", "-n", "48", "-t", str(t), "-o", "json"], capture_output=True, text=True)
            l = json.loads(o.stdout)[0]["avg_ts"]
            rows.append((r, d, t, q, l)); print(f"round {r+1} {d} {t}t: qtune {q:.1f} llama.cpp {l:.1f}", flush=True)
