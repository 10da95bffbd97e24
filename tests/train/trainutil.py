"""Helpers for the training tests: the qtune binary, tiny models, pre-tokenized
data, job files, runs."""
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "ref"))
import st  # noqa: E402  (tests/ref/st.py)

SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
QTUNE = os.environ.get("QTUNE_BIN") or os.path.join(SRC, "build-train", "src", "cli", "qtune")


def env():
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    e.pop("QTUNE_LOG", None)
    return e


def run(*args, check=True, timeout=300):
    p = subprocess.run([QTUNE] + [str(a) for a in args], capture_output=True, text=True, env=env(), timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError("qtune %s failed (%d):\n%s\n%s" % (" ".join(map(str, args)), p.returncode, p.stdout,
                                                              p.stderr))
    return p


def init_model(path, preset="tiny", seed=3, dtype=None):
    args = ["init", "--out", path, "--preset", preset, "--seed", seed]
    if dtype:
        args += ["--dtype", dtype]
    run(*args)
    return path


def write_tokens(path, n, T, seed, vocab=512, min_len=None):
    """n pre-tokenized examples of random lengths in [min_len, T] (all labelled)."""
    rng = np.random.default_rng(seed)
    rows = []
    with open(path, "w") as f:
        for _ in range(n):
            L = int(rng.integers(min_len or T // 2, T + 1))
            # a learnable pattern: arithmetic runs with a random start and stride
            a, s = int(rng.integers(1, vocab)), int(rng.integers(1, 4))
            ids = [int((a + s * k) % (vocab - 1) + 1) for k in range(L)]
            rows.append(ids)
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return rows


def write_job(path, model, out, train, eval_=None, T=16, lora=None, train_opts=None, ds=None, data_opts=None):
    job = {"model": model, "output_dir": out,
           "data": dict({"train": train, "seq_len": T, "packing": False, "shuffle": False}, **(data_opts or {})),
           "train": dict({"max_steps": 4, "log_steps": 1, "seed": 7}, **(train_opts or {}))}
    if eval_:
        job["data"]["eval"] = eval_
    if lora:
        job["lora"] = lora
    job["deepspeed"] = ds if ds is not None else {"train_micro_batch_size_per_gpu": 2,
                                                  "gradient_accumulation_steps": 2}
    with open(path, "w") as f:
        json.dump(job, f, indent=1)
    return path


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def step_lines(out):
    return [m for m in metrics(out) if "loss" in m]


def optimizer_state(ck):
    """Adam m and v of a checkpoint folder as whole (n) arrays: the parts its
    trainer_state.json lists, one file per writing rank, put back in order
    (or the single optimizer.safetensors of format-1 checkpoints)."""
    with open(os.path.join(ck, "trainer_state.json")) as f:
        state = json.load(f)
    if "optimizer" not in state:
        return st.read(os.path.join(ck, "optimizer.safetensors"))
    parts = [st.read(os.path.join(ck, p["file"])) for p in state["optimizer"]["parts"]]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("exp_avg", "exp_avg_sq")}
