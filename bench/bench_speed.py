"""bench/run's driver: qtune training speed against the PyTorch reference and
against the machine's measured GEMM peak, a precision table, and (--profile)
where qtune's step time goes. docs/benchmarks.md states every formula.

In one run, sequentially (never two heavy processes at once):
  1. bench_gemm: best OpenBLAS sgemm GFLOP/s on square 1024/2048 matrices at
     each thread count; oneDNN bf16 where the CPU has AVX512_BF16/AMX.
  2. per case (shape x mode x threads): `qtune train` on a generated job (fp32),
     the same job in bf16 (--bf16: auto = where the CPU has AVX512_BF16), then
     bench/torch_train.py (fp32) on the same model folder and rows. tokens/s
     are medians over the steps after the warm-up ones.
  3. precision table: the same qtune job with deepspeed fp16 / bf16 sections.
  4. --profile: sgemm time by shape (LD_PRELOAD tracer) and `perf record`
     self time by symbol, one thread.

usage: /usr/bin/python3 bench/bench_speed.py [--build DIR] [--quick] [--steps N] [--warmup W]
       [--shapes bench-tiny,qwen2.5-0.5b] [--modes lora,full] [--threads 1,2] [--bf16 auto|on|off] [--isa avx2]
       [--no-torch] [--no-precision] [--profile] [--work DIR] [--json OUT.json]
       /usr/bin/python3 bench/bench_speed.py --report A.json [B.json ...]"""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# shape name -> (micro-batch B, seq_len T), from issue 7; tiny (the test preset: vocab 512, hidden 64, 2 layers)
# from issue 46, at bench-tiny's batch: a step there is mostly per-op overhead, not GEMM
SHAPES = {"tiny": (4, 256), "bench-tiny": (4, 256), "qwen2.5-0.5b": (1, 256)}
# At least this many (warm-up, measured) steps for a shape whose steps take milliseconds: 2 steps of 20 ms
# moved the tiny rows by 30% between runs (bench/RESULTS.md); 200 take a few seconds a case on either side.
MIN_STEPS = {"tiny": (5, 200)}
LORA_R, LORA_ALPHA = 8, 16
CE_CHUNK = 2048  # OP_CE_CHUNK of src/backend/cpu/ops.h, only used to label traced sgemm shapes


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception:  # noqa: BLE001 - machine facts are best effort
        return ""


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def thread_env(n):
    return dict(os.environ, OMP_NUM_THREADS=str(n), OPENBLAS_NUM_THREADS=str(n), MKL_NUM_THREADS=str(n))


# ---- FLOPs ---------------------------------------------------------------------
def dims(cfg):
    C = cfg["hidden_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    D = cfg.get("head_dim") or C // H
    return C, cfg["intermediate_size"], cfg["num_hidden_layers"], H, KV, D, cfg["vocab_size"]


def flops_per_step(cfg, B, T, mode, r=LORA_R):
    """Model FLOPs of one training step (multiply-add = 2), recomputation not
    counted. N_mm = weights that multiply activations (7 linears per layer +
    lm_head; the embedding lookup is not a matmul). Attention (causal, keys
    0..t for query t): forward 2*H*D*T*(T+1) per layer and row (QK^T and PV),
    backward twice that.
      full: 6 * N_mm * B*T + 3 * attn_fwd
      lora: 2 * N_mm * B*T (forward) + 2 * (N_mm - C*(H*D + 2*KV*D)) * B*T
            (input gradients; layer 0's q/k/v input gradient is not needed
            because nothing below it trains) + 3 * attn_fwd
            + (6 * r * (in + out) * L - 2 * r * in) * B*T per adapted module
            (q_proj, v_proj; forward 2r(in+out), backward dB, dh, dA, dx, with
            no dx in layer 0)."""
    C, I, L, H, KV, D, V = dims(cfg)
    tok = B * T
    n_mm = L * (C * H * D + 2 * C * KV * D + H * D * C + 3 * C * I) + V * C
    attn_fwd = L * B * 2 * H * D * T * (T + 1)
    if mode == "full":
        return 6 * n_mm * tok + 3 * attn_fwd, n_mm
    adapters = sum(6 * r * (i + o) * L - 2 * r * i for i, o in ((C, H * D), (C, KV * D))) * tok
    return 2 * n_mm * tok + 2 * (n_mm - C * (H * D + 2 * KV * D)) * tok + 3 * attn_fwd + adapters, n_mm


# ---- pieces --------------------------------------------------------------------
def bench_gemm_rows(build, t, args, must=False):
    """bench_gemm's JSON lines for one call at t threads: [] when it fails,
    or with must, the benchmark stops with its error."""
    r = subprocess.run([os.path.join(build, "bench", "bench_gemm"), "--threads", str(t)] + args,
                       capture_output=True, text=True, env=thread_env(t))
    if r.returncode:
        if must:
            sys.exit("bench_gemm failed: " + r.stderr)
        return []
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


def gemm_peak(build, threads, reps):
    """The square-sgemm peak of each thread count, on OpenBLAS and on oneDNN's
    dnnl_sgemm (qtune runs its input-gradient products on the latter where it
    loads): "peak used" is the better of the two, so qtune is held against the
    fastest fp32 GEMM the machine's libraries reach."""
    exe = os.path.join(build, "bench", "bench_gemm")
    out = {}
    for t in threads:
        rows = [x for extra in ([], ["--onednn"]) for x in bench_gemm_rows(build, t, ["--reps", str(reps)] + extra,
                                                                          must=True) if x.get("gflops")]
        best = max(rows, key=lambda x: x["gflops"])
        rb = subprocess.run([exe, "--bf16", "--threads", str(t), "--reps", str(reps)], capture_output=True, text=True,
                            env=thread_env(t))
        bf = json.loads(rb.stdout) if rb.returncode == 0 else {"gflops": None, "note": rb.stderr.strip()}
        out[t] = {"sgemm": rows, "peak_gflops": best["gflops"], "peak_shape": best["M"],
                  "peak_lib": best.get("lib", "openblas"), "bf16": bf,
                  "peak_cpu_gflops": max(x["cpu_gflops"] for x in rows),
                  "load": loadavg()}
        log("  peak %d thread(s): sgemm %s; bf16 %s" % (t, ", ".join("%s %d: %.1f GFLOP/s" % (
            x.get("lib", "openblas"), x["M"], x["gflops"]) for x in rows),
            bf.get("note") or "%.1f GFLOP/s" % bf["gflops"]))
    return out


def peak_near(build, t, reps=3):
    """Best square-2048 sgemm GFLOP/s at t threads right now (the better of
    OpenBLAS and oneDNN). Measured before and after every qtune case: the
    host's speed drifts by +-10% over minutes (other tenants of the physical
    machine), so the run-start peak alone can make a case look slower or
    faster than it is against what the cores gave at the time."""
    rates = [x["gflops"] for extra in ([], ["--onednn"])
             for x in bench_gemm_rows(build, t, ["--reps", str(reps), "--size", "2048"] + extra) if x.get("gflops")]
    return max(rates, default=None)


def bf16_plan(setting, cpuinfo=None):
    """(run, why): whether each speed case also runs qtune in bf16 and, when
    not, the reason printed under the tables. auto runs it only where the CPU
    has AVX512_BF16, the flag qtune's native bf16 path needs (oneDNN bf16
    GEMM): elsewhere qtune refuses bf16, or with QTUNE_BF16_EMULATE=1 stores
    bf16 and computes in fp32, which is not a speed figure. on runs it
    whatever the CPU (a refusal is reported as the case's bf16 error)."""
    if setting == "off":
        return False, "not run (--bf16 off)"
    if setting == "on":
        return True, None
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    if re.search(r"\bavx512_bf16\b", cpuinfo):
        return True, None
    return False, "not run: this CPU has no AVX512_BF16 (--bf16 auto; emulated bf16 is not a speed figure)"


def ensure_model(qtune, work, preset):
    d = os.path.join(work, "models", preset + "-f32")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        log("  qtune init --preset %s --dtype f32" % preset)
        subprocess.run([qtune, "init", "--preset", preset, "--dtype", "f32", "--out", d, "--force"], check=True,
                       capture_output=True, env=thread_env(2))
    with open(os.path.join(d, "config.json")) as f:
        return d, json.load(f)


def ensure_data(work, V, T, rows):
    """rows pre-tokenized examples of exactly T random ids (fixed seed)."""
    import numpy as np
    p = os.path.join(work, "data-V%d-T%d-n%d.jsonl" % (V, T, rows))
    if not os.path.exists(p):
        rng = np.random.default_rng(1234)
        with open(p + ".tmp", "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"input_ids": rng.integers(0, V, T).tolist()}) + "\n")
        os.replace(p + ".tmp", p)
    return p


def write_job(path, model, out, data, B, T, steps, mode, precision="fp32"):
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.0}},
          "zero_optimization": {"stage": 0}}
    if precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    elif precision == "bf16":
        ds["bf16"] = {"enabled": True}
    job = {"model": model, "output_dir": out,
           "data": {"train": data, "format": "tokens", "seq_len": T, "packing": False, "shuffle": False,
                    "mask_prompt": False},
           "train": {"max_steps": steps, "save_steps": 0, "log_steps": 1, "seed": 42, "resume": "never",
                     "overwrite_output_dir": True},
           "deepspeed": ds}
    if mode == "lora":
        job["lora"] = {"r": LORA_R, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
                       "target_modules": ["q_proj", "v_proj"]}
    with open(path, "w") as f:
        json.dump(job, f, indent=1)


def median(x):
    return statistics.median(x) if x else None


def run_qtune(qtune, work, model, data, B, T, mode, threads, warmup, steps, precision="fp32", prefix=None):
    """Returns {tok_s: median over steps > warmup, steps: [...], mem_peak_bytes, wall_s} or {error}."""
    tag = "%s-%s-t%d-%s" % (os.path.basename(model), mode, threads, precision)
    job, out = os.path.join(work, tag + ".json"), os.path.join(work, "run-" + tag)
    write_job(job, model, out, data, B, T, warmup + steps, mode, precision)
    cmd = (prefix or []) + [qtune, "train", job]
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=thread_env(threads))
    # CPU seconds per step: sample the process's utime+stime whenever a new
    # metrics line appears (the line is written right after its step)
    metrics, cpu_marks, seen = os.path.join(out, "metrics.jsonl"), [], 0
    while proc.poll() is None:
        time.sleep(0.05)
        try:
            with open(metrics) as f:
                n = sum(1 for x in f if '"tokens_per_s"' in x)
        except OSError:
            n = 0
        if n > seen or not cpu_marks:
            c = proc_cpu_s(proc.pid)
            if c is not None:
                if not cpu_marks:
                    cpu_marks.append((0, c))  # before the first line: start of training (plus load time)
                if n > seen:
                    cpu_marks.append((n, c))
            seen = n
    stdout, stderr = proc.communicate()
    wall = time.time() - t0
    if proc.returncode:
        shutil.rmtree(out, ignore_errors=True)
        return {"error": (stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "rc": proc.returncode}
    lines = [json.loads(x) for x in open(metrics) if x.strip()]
    st = [x for x in lines if "tokens_per_s" in x]
    shutil.rmtree(out, ignore_errors=True)  # 0.5B checkpoints are GBs
    meas = st[warmup:]
    # CPU seconds of the steps after warm-up that were seen one line at a time
    cpu_steps = [(c1 - c0) / (n1 - n0) for (n0, c0), (n1, c1) in zip(cpu_marks, cpu_marks[1:])
                 if n0 >= max(warmup, 1) and n1 - n0 == 1] if len(cpu_marks) > 1 else []
    return {"tok_s": median([x["tokens_per_s"] for x in meas]), "tok_s_all": [x["tokens_per_s"] for x in st],
            "cpu_s_step": median(cpu_steps), "mem_peak_bytes": max(x.get("mem_peak_bytes", 0) for x in st),
            "wall_s": wall, "loss": [x.get("loss") for x in st], "skipped": sum(1 for x in meas if x.get("skipped")),
            "tokens": st[0]["tokens"], "load": loadavg()}


def proc_cpu_s(pid):
    """utime + stime of a live process, seconds (all its threads)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_torch(work, model, data, B, T, mode, threads, warmup, steps):
    cmd = ["/usr/bin/python3", os.path.join(HERE, "torch_train.py"), "--model", model, "--data", data, "--B", str(B),
           "--T", str(T), "--steps", str(warmup + steps), "--threads", str(threads)]
    if mode == "lora":
        cmd += ["--lora", str(LORA_R), str(LORA_ALPHA)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(threads))
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    o = json.loads(r.stdout.strip().splitlines()[-1])
    tok = [B * T / s for s in o["step_s"]]
    return {"tok_s": median(tok[warmup:]), "tok_s_all": tok, "cpu_s_step": median(o["step_cpu_s"][warmup:]), "maxrss_bytes": o["maxrss_bytes"], "loss": o["loss"],
            "load": loadavg()}


# ---- profile -------------------------------------------------------------------
def slices(n, threads):
    """The widths op_split gives each of `threads` threads (16-aligned blocks)."""
    per = -(-n // threads)
    per = -(-per // 16) * 16
    return {min(per, n - k * per) for k in range(threads) if k * per < n}


def label_shapes(cfg, B, T, mode, threads=1):
    """(M, N, K, ta, tb) -> call site, from the calls op_matmul / op_lmhead_ce
    make. With threads > 1 each thread multiplies its slice: the output
    features of a forward or a dW, the input features of a dX."""
    C, I, L, H, KV, D, V = dims(cfg)
    N, R = B * T, LORA_R
    lab = {}

    def add(M, Nn, K, ta, tb, name):
        split_m = (ta, tb) == ("t", "n")  # dW: rows of W; otherwise columns of the output
        for w in slices(M if split_m else Nn, threads):
            lab.setdefault((w, Nn, K, ta, tb) if split_m else (M, w, K, ta, tb), []).append(name)

    lin = {"q_proj": (C, H * D), "k_proj": (C, KV * D), "v_proj": (C, KV * D), "o_proj": (H * D, C),
           "gate/up_proj": (C, I), "down_proj": (I, C)}
    for name, (i, o) in lin.items():
        add(N, o, i, "n", "t", name + " fwd")
        add(N, i, o, "n", "n", name + " bwd dX")
        add(o, i, N, "t", "n", name + " bwd dW")
        if mode == "lora" and name in ("q_proj", "v_proj"):
            add(N, R, i, "n", "t", "lora_A fwd")
            add(N, o, R, "n", "t", "lora_B fwd")
            add(o, R, N, "t", "n", "lora_B dW")
            add(N, R, o, "n", "n", "lora dh")
            add(R, i, N, "t", "n", "lora_A dW")
            add(N, i, R, "n", "n", "lora dX")
    for cv in {CE_CHUNK, V % CE_CHUNK or CE_CHUNK}:
        add(N, cv, C, "n", "t", "lm_head chunk logits (calls/step = 2x chunks when the backward recomputes them)")
        add(N, C, cv, "n", "n", "lm_head chunk bwd dX")
        add(cv, C, N, "t", "n", "lm_head chunk bwd dW")
    # attention on 64x64 blocks (op_attention.c): the full blocks' shapes; the
    # last, partial block of a row and blocks trimmed to fewer rows show as "?"
    b = min(T, 64)
    lab.setdefault((b, b, D, "n", "t"), []).append("attention S = QK^T / dP = dO V^T")
    lab.setdefault((b, D, b, "n", "n"), []).append("attention O += PV / dQ += dS K")
    lab.setdefault((b, D, b, "t", "n"), []).append("attention dV += P^T dO / dK += dS^T Q")
    return {k: " / ".join(dict.fromkeys(v)) for k, v in lab.items()}


def standalone_rates(build, rows):
    """The same sgemm shapes timed alone by bench_gemm (1 thread, best of 3):
    tells a shape that OpenBLAS runs slowly anyway from one that is slow only
    inside the step (cold caches, beta handling, interference)."""
    exe = os.path.join(build, "bench", "bench_gemm")
    for r in rows:
        try:
            o = subprocess.run([exe, "--shape", str(r["M"]), str(r["N"]), str(r["K"]), r["ta"], r["tb"], "--reps",
                                "3"], capture_output=True, text=True, env=thread_env(1), timeout=120)
            r["alone_gflops"] = json.loads(o.stdout)["gflops"] if o.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, KeyError):
            r["alone_gflops"] = None


def profile_case(build, qtune, work, model, cfg, data, B, T, mode, warmup, steps, threads=1):
    """With threads > 1 the tracer's seconds are summed over the threads that
    call sgemm at once (each on its slice), so s_per_step is thread-seconds
    and the rates are per thread."""
    tr = os.path.join(work, "sgemm-%s-%s-t%d.tsv" % (os.path.basename(model), mode, threads))
    lib = os.path.join(build, "bench", "libqt_sgemm_trace.so")
    # the tracer wraps OpenBLAS's cblas_sgemm; the input-gradient products qtune
    # runs on oneDNN (opened with dlopen) would escape it, so the traced run
    # keeps them on OpenBLAS. The perf run below uses qtune's default.
    env_prefix = ["env", "QTUNE_SGEMM_TRACE=" + tr, "LD_PRELOAD=" + lib, "QTUNE_SGEMM=openblas"]
    res = run_qtune(qtune, work, model, data, B, T, mode, threads, warmup, steps, prefix=env_prefix)
    if "error" in res:
        return {"error": res["error"]}
    nsteps = warmup + steps
    step_s = B * T / res["tok_s"]
    labels = label_shapes(cfg, B, T, mode, threads)
    rows = []
    for line in open(tr):
        if line.startswith(("order", "#")):
            continue
        _, M, N, K, ta, tb, calls, sec, gf = line.split("\t")
        M, N, K, calls, sec, gf = int(M), int(N), int(K), int(calls), float(sec), float(gf)
        rows.append({"M": M, "N": N, "K": K, "ta": ta, "tb": tb, "calls_per_step": calls / nsteps,
                     "s_per_step": sec / nsteps, "gflops": gf, "site": labels.get((M, N, K, ta, tb), "?")})
    rows.sort(key=lambda x: -x["s_per_step"])
    standalone_rates(build, rows[:6])
    # perf: self time by symbol (software clock; this VM has no hardware counters)
    perf_rows, perf_note = [], ""
    pdata = os.path.join(work, "perf-%s.data" % mode)
    if shutil.which("perf"):
        pr = run_qtune(qtune, work, model, data, B, T, mode, threads, warmup, steps,
                       prefix=["perf", "record", "-q", "-e", "cpu-clock", "-F", "499", "-o", pdata, "--"])
        if "error" not in pr:
            rep = subprocess.run(["perf", "report", "-i", pdata, "--stdio", "--no-children", "--sort",
                                  "dso,symbol", "--percent-limit", "0.5"], capture_output=True, text=True)
            for line in rep.stdout.splitlines():
                m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)$", line)
                if m:
                    sym = re.sub(r"(\s+-)+\s*$", "", m.group(3)).strip()  # empty srcline columns
                    perf_rows.append({"pct": float(m.group(1)), "dso": m.group(2), "symbol": sym})
        else:
            perf_note = pr["error"]
        if os.path.exists(pdata):
            os.remove(pdata)
    else:
        perf_note = "perf not found"
    return {"step_s": step_s, "tok_s": res["tok_s"], "threads": threads, "sgemm": rows, "perf": perf_rows,
            "perf_note": perf_note,
            "note": "sgemm seconds are per step averaged over all %d steps (warm-up included); step_s is the "
                    "median step of the traced run, which keeps every product on OpenBLAS (QTUNE_SGEMM=openblas) "
                    "so that the tracer sees it; the perf table is of a run with qtune's default (input-gradient "
                    "products on oneDNN)" % nsteps}


# ---- report --------------------------------------------------------------------
def fmt(x, f="%.0f"):
    return "-" if x is None else f % x


def ratio(a, b):
    return "%.2f" % (a / b) if a and b else "-"


def bf16_notes(res, cpu=False):
    """Lines under a speed table: why bf16 columns show "-" (grouped by
    reason, cases named), and issue 7's bf16 target (bf16 >= 1.5x PyTorch's
    fp32) over the cases that have both figures: by tok/s, or with cpu by
    CPU seconds per step."""
    why, met, n = {}, 0, 0
    for c in res["cases"]:
        qb, t = c.get("qtune_bf16"), c.get("torch") or {}
        name = "%s %s t%d" % (c["shape"], c["mode"], c["threads"])
        if qb is None:
            why.setdefault("not measured: this JSON file predates the bf16 runs", []).append(name)
        elif "not_run" in qb:
            why.setdefault(qb["not_run"], []).append(name)
        elif "error" in qb:
            why.setdefault("failed: " + qb["error"], []).append(name)
        elif cpu and qb.get("cpu_s_step") and t.get("cpu_s_step"):
            n += 1
            met += t["cpu_s_step"] >= 1.5 * qb["cpu_s_step"]
        elif not cpu and qb.get("tok_s") and t.get("tok_s"):
            n += 1
            met += qb["tok_s"] >= 1.5 * t["tok_s"]
    lines = ["bf16 columns \"-\" in %s: %s" % ("every case" if len(v) == len(res["cases"]) else ", ".join(v), k)
             for k, v in why.items()]
    if n:
        lines.append("issue 7's target, qtune bf16 >= 1.5x PyTorch fp32 (%s): met in %d of %d cases" % (
            "CPU s/step" if cpu else "tok/s", met, n))
    return lines


def triad_near(build, t, reps=3):
    """Memory bandwidth right now (bench_gemm --triad: STREAM's triad, best
    GB/s, t threads). Measured beside the sgemm peak before and after every
    qtune case: the step streams 2 GB of weights and its activations through
    memory each step, and a square sgemm that lives in cache does not feel
    another tenant's memory traffic; the triad does."""
    rows = bench_gemm_rows(build, t, ["--triad", "--reps", str(reps)])
    return rows[0]["gbs"] if rows and rows[0].get("gbs") else None


def report_ab(res):
    cases = [c for c in res.get("cases", []) if c.get("ab")]
    if not cases:
        return
    print("\n## Against the baseline binary (alternating runs, medians of each run's post-warm-up steps)\n")
    print("| shape | mode | threads | new tok/s (runs) | baseline tok/s (runs) | new / baseline | >= 0.97 | "
          "CPU s/step new / baseline (medians) | baseline / new CPU s | load after the runs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        ab = c["ab"]
        if ab.get("error"):
            print("| %s | %s | %d | %s | | | | | | |" % (c["shape"], c["mode"], c["threads"], ab["error"]))
            continue
        nc, bc = [x for x in ab.get("new_cpu", []) if x], [x for x in ab.get("base_cpu", []) if x]
        cpu = "%.3f / %.3f" % (median(nc), median(bc)) if nc and bc else "-"
        loads = [l.split()[0] for l in ab.get("loads", []) if l]
        print("| %s | %s | %d | %.1f (%s) | %.1f (%s) | %.3f | %s | %s | %s | %s |" % (
            c["shape"], c["mode"], c["threads"], median(ab["new"]), ", ".join("%.1f" % x for x in ab["new"]),
            median(ab["base"]), ", ".join("%.1f" % x for x in ab["base"]), ab["ratio"],
            "yes" if ab["ratio"] >= 0.97 else "**no**", cpu, fmt(ab.get("cpu_ratio"), "%.3f"),
            "%s-%s" % (min(loads, key=float), max(loads, key=float)) if loads else "-"))


def report(res):
    report_ab(res)
    p = print
    p("\n## Machine\n")
    for k, v in res["machine"].items():
        p("- %s: %s" % (k, v))
    p("\n## Measured GEMM peak (best of %d, square n x t sgemm on OpenBLAS and on oneDNN; peak used: the better; "
      "bf16: square 2048 bf16 x bf16 -> f32)\n" % res["reps"])
    p("| threads | sgemm 1024 GFLOP/s | sgemm 2048 GFLOP/s | oneDNN sgemm 1024 | oneDNN sgemm 2048 | peak used | "
      "GFLOP per CPU-second | bf16 (oneDNN) | load avg |")
    p("|---|---|---|---|---|---|---|---|---|")
    for t, g in res["peak"].items():
        by = {(x.get("lib", "openblas"), x["M"]): x["gflops"] for x in g["sgemm"]}
        bf = g["bf16"]
        p("| %s | %s | %s | %s | %s | %.1f (%s) | %.1f | %s | %s |" % (
            t, fmt(by.get(("openblas", 1024)), "%.1f"), fmt(by.get(("openblas", 2048)), "%.1f"),
            fmt(by.get(("onednn", 1024)), "%.1f"), fmt(by.get(("onednn", 2048)), "%.1f"), g["peak_gflops"],
            g.get("peak_lib", "openblas"), g["peak_cpu_gflops"], bf.get("note") or "%.1f GFLOP/s" % bf["gflops"],
            g["load"]))
    p("\n## Training speed: qtune vs PyTorch %s (fp32 unless a column says bf16; PyTorch always fp32; medians "
      "of the steps after %d warm-up (a shape of bench_speed.py's MIN_STEPS: its own); \"n\" = measured steps)\n"
      % (res["torch_version"], res["warmup"]))
    p("Wall clock (tokens / step wall time; the machine is shared, see load avg):\n")
    p("| shape | B x T | mode | threads | n | qtune tok/s | PyTorch tok/s | qtune / PyTorch | qtune bf16 tok/s | "
      "bf16 / PyTorch fp32 | bf16 / qtune fp32 | GFLOP/step | qtune GFLOP/s | % of sgemm peak | "
      "% of OpenBLAS sgemm peak | % of peak around the case | triad GB/s before / after | "
      "bf16 % of bf16 (oneDNN) peak | qtune peak RSS | PyTorch peak RSS | load avg |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        q, t, qb = c["qtune"], c.get("torch") or {}, c.get("qtune_bf16") or {}
        qt, tt, bt = q.get("tok_s"), t.get("tok_s"), qb.get("tok_s")
        gfs = c["flops"] * qt / c["tokens"] / 1e9 if qt else None
        pk = res["peak"].get(str(c["threads"]), {})
        peak = pk.get("peak_gflops")
        # issue 7's literal yardstick: OpenBLAS's square sgemm alone (rows without "lib" predate oneDNN's)
        ob_peak = max([x["gflops"] for x in pk.get("sgemm", []) if x.get("lib", "openblas") == "openblas"
                       and x.get("gflops")], default=None)
        # the bf16 run's model FLOPs per second over the run-start oneDNN bf16 peak (square 2048) of as many threads
        bpeak = (pk.get("bf16") or {}).get("gflops")
        bgfs = c["flops"] * bt / c["tokens"] / 1e9 if bt else None
        near = max([x for x in q.get("peak_near") or [] if x], default=None)
        bw = q.get("triad_near") or []
        p("| %s | %dx%d | %s | %d | %d | %s | %s | %s | %s | %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            c["shape"], c["B"], c["T"], c["mode"], c["threads"], len(q.get("tok_s_all", [])) - c.get("warmup", res["warmup"]),
            fmt(qt, "%.1f"), fmt(tt, "%.1f"),
            ratio(qt, tt) if qt and tt else (q.get("error") or t.get("error") or "-"),
            fmt(bt, "%.1f"), ratio(bt, tt), ratio(bt, qt),
            c["flops"] / 1e9, fmt(gfs, "%.1f"), fmt(100 * gfs / peak if gfs and peak else None, "%.0f%%"),
            fmt(100 * gfs / ob_peak if gfs and ob_peak else None, "%.0f%%"),
            "%.0f%% of %.1f" % (100 * gfs / near, near) if gfs and near else "-",
            " / ".join(fmt(x, "%.1f") for x in bw) if bw else "-",
            "%.0f%% of %.1f" % (100 * bgfs / bpeak, bpeak) if bgfs and bpeak else "-",
            fmt(q.get("mem_peak_bytes") and q["mem_peak_bytes"] / 2**20, "%.0f MiB"),
            fmt(t.get("maxrss_bytes") and t["maxrss_bytes"] / 2**20, "%.0f MiB"), q.get("load", "")))
    notes = bf16_notes(res)
    if notes:
        p("")
        for line in notes:
            p(line)
    p("\nCPU time (CPU seconds of all the process's threads per step: insensitive to other processes "
      "holding the cores; idle-spinning threads count):\n")
    p("| shape | mode | threads | qtune CPU s/step | PyTorch CPU s/step | qtune / PyTorch (speed) | "
      "qtune bf16 CPU s/step | bf16 / PyTorch fp32 (speed) | bf16 / qtune fp32 (speed) | "
      "qtune GFLOP per CPU-s | % of sgemm GFLOP per CPU-s |")
    p("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        q, t, qb = c["qtune"], c.get("torch") or {}, c.get("qtune_bf16") or {}
        qc, tc, bc = q.get("cpu_s_step"), t.get("cpu_s_step"), qb.get("cpu_s_step")
        g = c["flops"] / qc / 1e9 if qc else None
        pk = res["peak"].get(str(c["threads"]), {}).get("peak_cpu_gflops")
        # speed ratios: the other side's CPU seconds per step over this side's
        p("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            c["shape"], c["mode"], c["threads"], fmt(qc, "%.2f"), fmt(tc, "%.2f"), ratio(tc, qc),
            fmt(bc, "%.2f"), ratio(tc, bc), ratio(qc, bc), fmt(g, "%.1f"),
            fmt(100 * g / pk if g and pk else None, "%.0f%%")))
    notes = bf16_notes(res, cpu=True)
    if notes:
        p("")
        for line in notes:
            p(line)
    if res.get("precision"):
        p("\n## Precision (qtune, deepspeed fp16 / bf16 sections)\n")
        p("| shape | mode | threads | precision | tok/s | vs fp32 | mem_peak_bytes | skipped steps | result |")
        p("|---|---|---|---|---|---|---|---|---|")
        for c in res["precision"]:
            base = next((x["tok_s"] for x in res["precision"] if x["shape"] == c["shape"] and x["mode"] == c["mode"]
                         and x["precision"] == "fp32" and x.get("tok_s")), None)
            p("| %s | %s | %d | %s | %s | %s | %s | %s | %s |" % (
                c["shape"], c["mode"], c["threads"], c["precision"], fmt(c.get("tok_s"), "%.1f"),
                fmt(c["tok_s"] / base if c.get("tok_s") and base else None, "%.2f"),
                fmt(c.get("mem_peak_bytes") and c["mem_peak_bytes"] / 2**20, "%.0f MiB"),
                fmt(c.get("skipped"), "%d"), "ok" if "error" not in c else "refused: " + c["error"]))
    for name, pr in (res.get("profile") or {}).items():
        nt = pr.get("threads", 1)
        p("\n## Profile: %s (%d thread%s)\n" % (name, nt, "s" if nt > 1 else ""))
        if "error" in pr:
            p("error: " + pr["error"])
            continue
        p("median step %.2f s (%.1f tok/s). %s.\n" % (pr["step_s"], pr["tok_s"], pr["note"]))
        tot = sum(r["s_per_step"] for r in pr["sgemm"]) / nt
        p("sgemm total: %.2f s per step = %.0f%% of the step%s\n" % (
            tot, 100 * tot / pr["step_s"], " (thread-seconds / %d)" % nt if nt > 1 else ""))
        # the traced calls' own FLOPs over their wall time: the rate the GEMMs
        # themselves reach inside the step, against the peak of as many threads
        # (perf's sample shares cannot give it: they cover load and save too)
        gf = sum(2.0 * r["M"] * r["N"] * r["K"] * r["calls_per_step"] for r in pr["sgemm"]) / 1e9
        pk = res.get("peak", {}).get(str(nt), {}).get("peak_gflops")
        if tot > 0:
            p("the traced sgemm calls: %.1f GFLOP per step in %.2f s: %.1f GFLOP/s%s\n" % (
                gf, tot, gf / tot, ", %.0f%% of the %d-thread sgemm peak" % (100 * gf / tot / pk, nt) if pk else ""))
        p("| call site | M | N | K | op | calls/step | s/step | %% of step | GFLOP/s in the step%s | "
          "GFLOP/s alone (bench_gemm, 1 thread) |" % (" (per thread)" if nt > 1 else ""))
        p("|---|---|---|---|---|---|---|---|---|---|")
        for r in pr["sgemm"][:16]:
            p("| %s | %d | %d | %d | %s%s | %.0f | %.3f | %.1f%% | %.1f | %s |" % (
                r["site"], r["M"], r["N"], r["K"], r["ta"], r["tb"], r["calls_per_step"], r["s_per_step"],
                100 * r["s_per_step"] / nt / pr["step_s"], r["gflops"], fmt(r.get("alone_gflops"), "%.1f")))
        if pr["perf"]:
            p("\nperf record -e cpu-clock, self time (whole process, top symbols):\n")
            p("| % | dso | symbol |")
            p("|---|---|---|")
            for r in pr["perf"][:20]:
                p("| %.1f | %s | %s |" % (r["pct"], r["dso"], re.sub(r"(\s+-)+\s*$", "", r["symbol"]).strip()))
        elif pr["perf_note"]:
            p("perf: " + pr["perf_note"])


def merge_results(paths, work):
    res = None
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if res is None:
            res = r
            res.setdefault("cases", [])
            continue
        for t, g in r.get("peak", {}).items():
            best_cpu = max(g["peak_cpu_gflops"], res["peak"].get(t, g)["peak_cpu_gflops"])
            bf16 = max((x for x in (g.get("bf16"), res["peak"].get(t, {}).get("bf16")) if x),
                       key=lambda x: x.get("gflops") or 0, default={"gflops": None, "note": "-"})
            if t not in res["peak"] or g["peak_gflops"] > res["peak"][t]["peak_gflops"]:
                res["peak"][t] = g
            res["peak"][t]["peak_cpu_gflops"] = best_cpu
            res["peak"][t]["bf16"] = bf16
        res["cases"] += r.get("cases", [])
        if r.get("precision"):
            res["precision"] = (res.get("precision") or []) + r["precision"]
        if r.get("profile"):
            res["profile"] = dict(res.get("profile") or {}, **r["profile"])
        res["machine"]["load average at end"] = r["machine"].get("load average at end")
    for c in res["cases"]:
        cfgp = os.path.join(work, "models", c["shape"] + "-f32", "config.json")
        if os.path.exists(cfgp):
            with open(cfgp) as f:
                c["flops"], c["n_mm"] = flops_per_step(json.load(f), c["B"], c["T"], c["mode"])
    return res


def machine_facts(build):
    import torch
    mem = sh("free -g | awk '/Mem:/{print $2}'")
    blas = sh("%s --size 64 --reps 1 | head -1" % os.path.join(build, "bench", "bench_gemm"))
    blas = json.loads(blas).get("openblas", "?") if blas.startswith("{") else "?"
    return {"cpu": sh("lscpu | sed -n 's/^Model name: *//p'") or platform.processor(),
            "cores": sh("nproc"), "memory": mem + " GiB",
            "cpu flags (SIMD)": " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
                                          if re.search(r"\b%s\b" % f, open("/proc/cpuinfo").read())),
            "kernel": platform.release(), "OpenBLAS": blas,
            "oneDNN": sh("dpkg-query -W -f '${Version}' libdnnl-dev") or "?",
            "torch": torch.__version__ + " (BLAS: the system libblas.so.3 -> OpenBLAS, ATen OpenMP)",
            "compiler": sh("cc --version | head -1"),
            # the tree is shared and edited while benchmarks run: record what was built
            "qtune source": "%s %s, uncommitted changes in: %s" % (
                sh("git -C %s rev-parse --short HEAD" % ROOT), sh("git -C %s log -1 --format=%%cd --date=iso" % ROOT),
                sh("git -C %s status --porcelain -- src | awk '{print $2}' | tr '\n' ' '" % ROOT) or "none"),
            "load average at start": loadavg()}


def build_isa(build):
    """How the qtune in build was compiled: -march=native (QTUNE_NATIVE=ON) or the AVX2 baseline."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            m = re.search(r"^QTUNE_NATIVE:BOOL=(\w+)", f.read(), re.M)
    except OSError:
        return "?"
    if not m:
        return "?"
    return "-march=native" if m.group(1).upper() in ("ON", "1", "TRUE", "YES") else "-mavx2 -mfma -mf16c (QTUNE_NATIVE=OFF)"


def run_ab(qtune, base, work, model, data, B, T, mode, threads, warmup, steps, rounds):
    """This build and a baseline binary on the same job, alternating (new, base, new, base, ...) so that both
    see the same minutes of a shared machine: {new: [tok/s medians], base: [...], ratio: median/median,
    new_cpu / base_cpu: [CPU s/step medians], cpu_ratio: median base CPU s / median new CPU s (above 1: the new
    build needs less CPU time per step), loads: [load average after each run, in run order]}. On a machine shared
    with other work the wall clock also counts time the process waited for a core; CPU time does not (it still
    counts the spin of threads that wait for a preempted sibling)."""
    new, old, new_cpu, old_cpu, loads = [], [], [], [], []
    for r in range(rounds):
        for exe, into, cpu in ((qtune, new, new_cpu), (base, old, old_cpu)):
            q = run_qtune(exe, work, model, data, B, T, mode, threads, warmup, steps)
            if q.get("error"):
                return {"error": "%s: %s" % (exe, q["error"])}
            into.append(q["tok_s"])
            cpu.append(q.get("cpu_s_step"))
            loads.append(q.get("load"))
        log("  A/B round %d: new %.1f, baseline %.1f tok/s; CPU s/step new %s, baseline %s (load %s)" % (
            r + 1, new[-1], old[-1], fmt(new_cpu[-1], "%.3f"), fmt(old_cpu[-1], "%.3f"), loads[-1]))
    res = {"new": new, "base": old, "ratio": median(new) / median(old), "new_cpu": new_cpu, "base_cpu": old_cpu,
           "loads": loads}
    nc, bc = [x for x in new_cpu if x], [x for x in old_cpu if x]
    if nc and bc:
        res["cpu_ratio"] = median(bc) / median(nc)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 measured steps, 3 GEMM repetitions")
    ap.add_argument("--steps", type=int, help="measured steps per case (default 4; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--shapes", default="bench-tiny,qwen2.5-0.5b")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: emulate an AVX2 machine on an AVX-512 one, for qtune and PyTorch alike: "
                    "OPENBLAS_CORETYPE=Haswell, ONEDNN_MAX_CPU_ISA=AVX2 (and DNNL_MAX_CPU_ISA, its older name), "
                    "ATEN_CPU_CAPABILITY=avx2; give it a qtune built with -DQTUNE_NATIVE=OFF (-mavx2 -mfma -mf16c)")
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="also run each speed case's qtune job in bf16, right after its fp32 run (auto: only where "
                         "/proc/cpuinfo has avx512_bf16)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-near", action="store_true", help="skip the sgemm peak and triad measured around each case "
                    "(on a busy machine they take minutes and mean little; the CPU s/step columns still compare)")
    ap.add_argument("--no-speed", action="store_true", help="skip the qtune/PyTorch cases")
    ap.add_argument("--no-precision", action="store_true")
    ap.add_argument("--precision-shapes", default="bench-tiny")
    ap.add_argument("--profile", action="store_true", help="sgemm trace + perf (--profile-threads, default 1)")
    ap.add_argument("--profile-threads", type=int, default=1)
    ap.add_argument("--profile-shapes", default="bench-tiny,qwen2.5-0.5b")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "qtune-bench"))
    ap.add_argument("--json", help="also write all results to this JSON file")
    ap.add_argument("--baseline", metavar="QTUNE",
                    help="another qtune binary (e.g. the previous main's) run on every speed case, alternating "
                         "with this build's --rounds times; the report gets a 'vs baseline' table with the ratio "
                         "of medians per case (the issue-18 gate: every case >= 0.97)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating new/baseline runs per case (--baseline)")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="only print the tables of earlier --json files, "
                    "merged (peak: the best of the files at each thread count; FLOPs recomputed)")
    a = ap.parse_args()
    if a.report:
        report(merge_results(a.report, a.work))
        return
    steps = a.steps or (2 if a.quick else 4)
    reps = 3 if a.quick else 5
    threads = [int(x) for x in a.threads.split(",")]
    qtune = os.path.join(a.build, "src", "cli", "qtune")
    for exe in (qtune, os.path.join(a.build, "bench", "bench_gemm")):
        if not os.path.exists(exe):
            sys.exit("%s is not built; run bench/run (it builds) or cmake --build %s" % (exe, a.build))
    os.makedirs(a.work, exist_ok=True)
    # qtune names the CPU's own OpenBLAS kernels where the library fell back to older ones (docs/performance.md,
    # item 6); PyTorch, bench_gemm and the sgemm tracer get the same OPENBLAS_CORETYPE, so both sides of every
    # ratio run the same kernels.
    isa_env = {}
    if a.isa == "avx2":
        # set before anything is started: every child (qtune, bench_gemm, PyTorch, the tracer) inherits them
        isa_env = {"OPENBLAS_CORETYPE": "Haswell", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                   "ATEN_CPU_CAPABILITY": "avx2"}
        os.environ.update(isa_env)
        log("emulating an AVX2 machine: %s" % " ".join("%s=%s" % kv for kv in sorted(isa_env.items())))
    blas_core = os.environ.get("OPENBLAS_CORETYPE")
    if not blas_core:
        d = subprocess.run([qtune, "doctor", "--no-table"], capture_output=True, text=True)
        m = re.search(r"qtune set OPENBLAS_CORETYPE=(\w+)", d.stdout)
        if m:
            blas_core = os.environ["OPENBLAS_CORETYPE"] = m.group(1)
            log("OpenBLAS fell back to older kernels on this CPU: OPENBLAS_CORETYPE=%s for every run, as qtune sets it"
                % blas_core)
    import torch
    res = {"machine": machine_facts(a.build), "steps": steps, "warmup": a.warmup, "reps": reps,
           "torch_version": torch.__version__, "command": " ".join(sys.argv), "bf16": a.bf16,
           "openblas_coretype": blas_core, "isa": a.isa, "isa_env": isa_env}
    if isa_env:
        res["machine"]["emulated ISA"] = "AVX2 (%s; qtune build: %s)" % (
            " ".join("%s=%s" % kv for kv in sorted(isa_env.items())), build_isa(a.build))
    bf16_run, bf16_why = bf16_plan(a.bf16)
    if isa_env and a.bf16 == "auto":  # an AVX2 machine has no AVX512_BF16: qtune refuses bf16 there
        bf16_run, bf16_why = False, "not run: an AVX2 machine has no AVX512_BF16 (--isa avx2, --bf16 auto)"
    log("GEMM peak")
    res["peak"] = {str(k): v for k, v in gemm_peak(a.build, threads, reps).items()}
    res["cases"] = []
    models = {}
    for shape in a.shapes.split(","):
        models[shape] = ensure_model(qtune, a.work, shape)
    def shape_steps(shape):
        w, n = MIN_STEPS.get(shape, (0, 0))
        return max(a.warmup, w), max(steps, n)
    need = max(SHAPES[s][0] * sum(shape_steps(s)) for s in models)
    for shape in ([] if a.no_speed else a.shapes.split(",")):
        B, T = SHAPES[shape]
        warmup, nsteps = shape_steps(shape)
        mdir, cfg = models[shape]
        data = ensure_data(a.work, cfg["vocab_size"], T, max(need, 64))
        for mode in a.modes.split(","):
            fl, n_mm = flops_per_step(cfg, B, T, mode)
            for t in threads:
                log("%s %s threads=%d (load %s)" % (shape, mode, t, loadavg()))
                near = (lambda f: f(a.build, t)) if not a.no_near else (lambda f: None)
                before, bw_before = near(peak_near), near(triad_near)
                q = run_qtune(qtune, a.work, mdir, data, B, T, mode, t, warmup, nsteps)
                q["peak_near"] = [before, near(peak_near)]
                q["triad_near"] = [bw_before, near(triad_near)]
                log("  qtune: %s; sgemm peak before/after %s; triad GB/s before/after %s" % (
                    q.get("error") or "%.1f tok/s %s" % (q["tok_s"], q["tok_s_all"]), q["peak_near"],
                    q["triad_near"]))
                # same job, threads, warm-up and steps, deepspeed "bf16": {"enabled": true}
                qb = {"not_run": bf16_why}
                if bf16_run:
                    qb = run_qtune(qtune, a.work, mdir, data, B, T, mode, t, warmup, nsteps, precision="bf16")
                    log("  qtune bf16: %s" % (qb.get("error") or "%.1f tok/s %s" % (qb["tok_s"], qb["tok_s_all"])))
                tr = None
                if not a.no_torch:
                    tr = run_torch(a.work, mdir, data, B, T, mode, t, warmup, nsteps)
                    log("  torch: %s" % (tr.get("error") or "%.1f tok/s %s" % (tr["tok_s"], tr["tok_s_all"])))
                case = {"shape": shape, "mode": mode, "threads": t, "B": B, "T": T, "tokens": B * T, "warmup": warmup,
                        "flops": fl, "n_mm": n_mm, "qtune": q, "qtune_bf16": qb, "torch": tr}
                if a.baseline:
                    case["ab"] = run_ab(qtune, os.path.abspath(a.baseline), a.work, mdir, data, B, T, mode, t,
                                        warmup, nsteps, a.rounds)
                res["cases"].append(case)
    if not a.no_precision:
        res["precision"] = []
        t = max(threads)
        for shape in a.precision_shapes.split(","):
            if shape not in models:
                models[shape] = ensure_model(qtune, a.work, shape)
            B, T = SHAPES[shape]
            mdir, cfg = models[shape]
            data = ensure_data(a.work, cfg["vocab_size"], T, max(need, 64))
            for mode in a.modes.split(","):
                for prec in ("fp32", "fp16", "bf16"):
                    log("precision %s %s %s threads=%d" % (shape, mode, prec, t))
                    q = run_qtune(qtune, a.work, mdir, data, B, T, mode, t, a.warmup, steps, precision=prec)
                    log("  %s" % (q.get("error") or "%.1f tok/s" % q["tok_s"]))
                    res["precision"].append(dict(q, shape=shape, mode=mode, threads=t, precision=prec))
    if a.profile:
        res["profile"] = {}
        for shape in a.profile_shapes.split(","):
            if shape not in models:
                models[shape] = ensure_model(qtune, a.work, shape)
            B, T = SHAPES[shape]
            mdir, cfg = models[shape]
            data = ensure_data(a.work, cfg["vocab_size"], T, max(need, 64))
            for mode in a.modes.split(","):
                log("profile %s %s (load %s)" % (shape, mode, loadavg()))
                key = "%s %s" % (shape, mode) + (" t%d" % a.profile_threads if a.profile_threads > 1 else "")
                res["profile"][key] = profile_case(a.build, qtune, a.work, mdir, cfg, data, B, T, mode, a.warmup,
                                                   steps, a.profile_threads)
    res["machine"]["load average at end"] = loadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    report(res)


if __name__ == "__main__":
    main()
