"""The benchmark's own tools (bench/): bench_gemm's JSON output, the sgemm
tracer, and bench_speed.flops_per_step held against the sgemm calls qtune
really makes in a training step (counted by the tracer)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(SRC, "build"))
QTUNE = os.environ.get("QTUNE_BIN", os.path.join(BUILD, "src", "cli", "qtune"))
GEMM = os.path.join(BUILD, "bench", "bench_gemm")
TRACE = os.path.join(BUILD, "bench", "libqt_sgemm_trace.so")
sys.path.insert(0, os.path.join(SRC, "bench"))
import bench_speed  # noqa: E402

ENV1 = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def need(*paths):
    for p in paths:
        if not os.path.exists(p):
            pytest.fail("%s is not built; build the project (cmake --build) first" % p)


def test_bench_gemm_shape_json():
    need(GEMM)
    r = subprocess.run([GEMM, "--shape", "64", "48", "32", "t", "n", "--reps", "2"], capture_output=True, text=True,
                       env=ENV1)
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    assert (o["M"], o["N"], o["K"], o["ta"], o["tb"]) == (64, 48, 32, "t", "n")
    assert o["gflops"] > 0 and o["cpu_gflops"] > 0 and o["median_gflops"] <= o["gflops"]


def test_bench_gemm_bf16_reports_cpu_support():
    need(GEMM)
    r = subprocess.run([GEMM, "--bf16", "--size", "32", "--reps", "1"], capture_output=True, text=True, env=ENV1)
    flags = open("/proc/cpuinfo").read()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["gflops"] > 0
    else:
        assert r.returncode == 0 and json.loads(r.stdout)["note"] == "n/a: no AVX512_BF16"


def test_bench_gemm_rejects_bad_arguments():
    need(GEMM)
    for args in (["--threads", "0"], ["--size", "-5"], ["--bogus"]):
        r = subprocess.run([GEMM] + args, capture_output=True, text=True, env=ENV1)
        assert r.returncode == 2, args


def test_tracer_counts_calls_by_shape(tmp_path):
    need(GEMM, TRACE)
    out = tmp_path / "t.tsv"
    env = dict(ENV1, LD_PRELOAD=TRACE, QTUNE_SGEMM_TRACE=str(out))
    r = subprocess.run([GEMM, "--shape", "40", "30", "20", "--reps", "3"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    rows = [x.split("\t") for x in out.read_text().splitlines()[1:]]
    assert len(rows) == 1
    order, M, N, K, ta, tb, calls = rows[0][:7]
    assert (order, M, N, K, ta, tb) == ("row", "40", "30", "20", "n", "t")
    assert int(calls) >= 4  # warm-up + 3 timed samples (each repeated to >= 20 ms)


def make_model(path, cfg):
    path.mkdir()
    (path / "in.json").write_text(json.dumps(cfg))
    r = subprocess.run([QTUNE, "init", "--config", str(path / "in.json"), "--out", str(path / "m"), "--dtype", "f32"],
                       capture_output=True, text=True, env=ENV1)
    assert r.returncode == 0, r.stderr
    return str(path / "m")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_flops_formula_matches_traced_sgemm(tmp_path, mode):
    """Sum of 2*M*N*K over every sgemm of training steps == the formula's
    matmul part, plus attention's block products, plus the lm_head logits if
    qtune recomputes them in the backward (2*V*C per token), which the
    formula leaves out on purpose (a fused loss+dx pass does not recompute).
    Attention runs on sgemm blocks (op_attention.c): with T <= 64 one (T x T)
    block pair per (layer, row, head), computed whole (the causal mask is
    applied after), 2 products in the forward (S, PV) and 5 in the backward
    (S, dP, dV, dK, dQ), each 2*T*T*D, where the formula counts the exact
    causal FLOPs."""
    need(QTUNE, TRACE)
    C, I, L, H, KV, D, V, B, T = 64, 96, 2, 4, 2, 16, 2500, 2, 16  # V > one 2048-row CE chunk
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": C, "intermediate_size": I,
           "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": L, "vocab_size": V,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128, "tie_word_embeddings": True,
           "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False}
    model = make_model(tmp_path / "model", cfg)
    rng = np.random.default_rng(0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": rng.integers(0, V, T).tolist()}) + "\n" for _ in range(8)))
    steps = 2
    job = tmp_path / "job.json"
    bench_speed.write_job(str(job), model, str(tmp_path / "run"), str(data), B, T, steps, mode)
    out = tmp_path / "trace.tsv"
    env = dict(ENV1, LD_PRELOAD=TRACE, QTUNE_SGEMM_TRACE=str(out))
    r = subprocess.run([QTUNE, "train", str(job)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    traced = 0
    for line in out.read_text().splitlines()[1:]:
        f = line.split("\t")
        traced += 2 * int(f[1]) * int(f[2]) * int(f[3]) * int(f[6])
    total, _ = bench_speed.flops_per_step(cfg, B, T, mode)
    attn = 3 * L * B * 2 * H * D * T * (T + 1)
    recompute = 2 * V * C * B * T
    attn_gemm = L * B * H * 7 * 2 * T * T * D
    assert traced in (steps * (total - attn + attn_gemm), steps * (total - attn + attn_gemm + recompute))
