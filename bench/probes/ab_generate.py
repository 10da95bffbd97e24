import json, subprocess, sys, os, statistics, random
"""Alternating `qtune generate --max-new 64` runs of several binaries on one model: decode tok/s, the
per-round ratio against the first binary (median), and whether the greedy ids agree.
  /usr/bin/python3 bench/probes/ab_generate.py ROUNDS THREADS MODEL BIN...
(bench/RESULTS-decode.md, session 15)"""
R, T, M, bins = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
env = dict(os.environ, OMP_NUM_THREADS=T, OPENBLAS_NUM_THREADS="1")
random.seed(5); prompt = ",".join(str(random.randrange(1000, 50000)) for _ in range(16))
res = {b: [] for b in bins}; ids = {}
for r in range(R):
    for b in (bins if r % 2 == 0 else bins[::-1]):
        o = subprocess.run([b, "generate", "--model", M, "--prompt-ids", prompt, "--max-new", "64", "--temperature", "0", "--json"],
                           capture_output=True, text=True, env=env)
        j = json.loads(o.stdout); res[b].append(j["decode_tokens_per_s"]); ids.setdefault(b, j["ids"])
for b in bins:
    rat = [v / res[bins[0]][i] for i, v in enumerate(res[b])]
    print(f"{os.path.basename(b):8s} tok/s median {statistics.median(res[b]):6.2f} (all {' '.join(f'{v:.1f}' for v in res[b])}) ratio med {statistics.median(rat):.3f}  ids same: {ids[b] == ids[bins[0]]}")
