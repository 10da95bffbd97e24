# decode old vs new, alternating: qtune generate --json, decode_tokens_per_s; f32 and bf16 0.5B folders of /work/qb
import json, os, subprocess, sys, statistics
old, new, rounds, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
ids = ",".join(str((7919 * i + 13) % 150000 + 1) for i in range(32))
res = {}
for r in range(rounds):
    for dt in ("f32", "bf16"):
        for t in threads:
            for name, q in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
                e = dict(os.environ, OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS="1", OPENBLAS_CORETYPE="Cooperlake")
                p = subprocess.run([q, "generate", "--model", "/work/qb/q05-" + dt, "--prompt-ids", ids, "--max-new", "64",
                                    "--temperature", "0", "--json"], capture_output=True, text=True, env=e)
                if p.returncode:
                    print(name, dt, t, "failed", p.stderr[-300:]); continue
                o = json.loads(p.stdout.strip().splitlines()[-1])
                v = o["decode_tokens_per_s"]
                res.setdefault((dt, t, name), []).append(v)
                print(r + 1, dt, "t" + t, name, round(v, 2), "load", open("/proc/loadavg").read().split()[0], flush=True)
for (dt, t, name), v in sorted(res.items()):
    print(dt, "t" + t, name, "median", round(statistics.median(v), 2), [round(x, 2) for x in v])
