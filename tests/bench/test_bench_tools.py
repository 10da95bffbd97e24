"""The benchmark's own tools (bench/): bench_gemm's JSON output, the sgemm
tracer, bench_speed.flops_per_step held against the sgemm calls qtune
really makes in a training step (counted by the tracer), and bench_speed's
report of the bf16 speed columns (synthetic results, old JSON files)."""
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


def test_bench_gemm_onednn_sgemm():
    """--onednn times oneDNN's dnnl_sgemm (square sizes and --shape), labelled
    "lib": "onednn"; the default is OpenBLAS, labelled "openblas"."""
    need(GEMM)
    for extra, lib in (([], "openblas"), (["--onednn"], "onednn")):
        r = subprocess.run([GEMM, "--size", "64", "--reps", "2"] + extra, capture_output=True, text=True, env=ENV1)
        assert r.returncode == 0, r.stderr
        o = json.loads(r.stdout)
        assert o["lib"] == lib and o["M"] == 64
        if lib == "onednn" and o["gflops"] is None:
            assert o["note"] == "n/a: built without oneDNN"
        else:
            assert o["gflops"] > 0
    r = subprocess.run([GEMM, "--onednn", "--shape", "40", "30", "20", "n", "n", "--reps", "2"], capture_output=True,
                       text=True, env=ENV1)
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    assert o["lib"] == "onednn" and (o["ta"], o["tb"]) == ("n", "n")


def test_bench_gemm_bf16_reports_cpu_support():
    need(GEMM)
    r = subprocess.run([GEMM, "--bf16", "--size", "32", "--reps", "1"], capture_output=True, text=True, env=ENV1)
    flags = open("/proc/cpuinfo").read()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["gflops"] > 0
    else:
        assert r.returncode == 0 and json.loads(r.stdout)["note"] == "n/a: no AVX512_BF16"


def test_bench_gemm_triad():
    """--triad: STREAM's triad bandwidth in GB/s (the result is checked inside: the program exits 1 if the
    last element is not b + 3 c), bytes counted as 3 arrays of 64 Mi floats."""
    need(GEMM)
    r = subprocess.run([GEMM, "--triad", "--reps", "2"], capture_output=True, text=True, env=ENV1)
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    assert o["kind"] == "triad" and o["threads"] == 1 and o["bytes_per_pass"] == 3 * 4 * (64 << 20)
    assert 0 < o["median_gbs"] <= o["gbs"] < 10000


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
    # the tracer wraps cblas_sgemm: keep the input-gradient products on OpenBLAS (not oneDNN) so it sees them all
    env = dict(ENV1, LD_PRELOAD=TRACE, QTUNE_SGEMM_TRACE=str(out), QTUNE_SGEMM="openblas")
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


# ---- bench_speed's report: bf16 columns (synthetic results, nothing run) --------
def table(out, first_header):
    """{(shape, mode, threads): {column: cell}} of the markdown table whose
    header row starts with first_header, and the text lines right after it."""
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith(first_header))
    head = [x.strip() for x in lines[i].strip("|").split("|")]
    rows, k = {}, i + 2
    while k < len(lines) and lines[k].startswith("|"):
        d = dict(zip(head, [x.strip() for x in lines[k].strip("|").split("|")]))
        rows[(d["shape"], d["mode"], int(d["threads"]))] = d
        k += 1
    after = []
    for x in lines[k + 1:]:
        if not x.strip():
            break
        after.append(x)
    return rows, after


def synthetic_results(bf16_of=None):
    """Two-case results as bench_speed.main() stores them; bf16_of(case index)
    gives the case's "qtune_bf16"; without it the cases have none (JSON files
    written before the bf16 runs)."""
    peak = {"2": {"sgemm": [{"M": 2048, "gflops": 150.0}], "peak_gflops": 150.0, "peak_shape": 2048,
                  "peak_cpu_gflops": 75.0, "load": "1 1 1",
                  "bf16": {"kind": "bf16", "threads": 2, "gflops": 400.0}}}
    cases = []
    for i, mode in enumerate(("lora", "full")):
        c = {"shape": "bench-tiny", "mode": mode, "threads": 2, "B": 4, "T": 256, "tokens": 1024,
             "flops": 200e9, "n_mm": 1,
             "qtune": {"tok_s": 500.0, "tok_s_all": [450.0, 500.0, 500.0], "cpu_s_step": 4.0, "peak_near": [140.0],
                       "mem_peak_bytes": 2**28, "load": "1 1 1"},
             "torch": {"tok_s": 250.0, "tok_s_all": [250.0] * 3, "cpu_s_step": 9.0, "maxrss_bytes": 2**30}}
        if bf16_of:
            c["qtune_bf16"] = bf16_of(i)
        cases.append(c)
    return {"machine": {"cpu": "test"}, "reps": 3, "warmup": 1, "steps": 2, "torch_version": "1.13", "peak": peak,
            "cases": cases}


def test_report_bf16_columns(capsys):
    """A measured bf16 case: its tok/s, bf16 / PyTorch fp32, bf16 / qtune fp32,
    its model FLOP/s over the oneDNN bf16 peak, and the same from CPU
    seconds; a case whose bf16 run was not made (no AVX512_BF16) shows "-"
    and the reason under both tables."""
    why = bench_speed.bf16_plan("auto", "flags : fpu avx2 avx512f")[1]
    # as run_qtune returns it ("skipped" counts overflow-skipped steps)
    measured = {"tok_s": 800.0, "tok_s_all": [700.0, 800.0, 800.0], "cpu_s_step": 2.5, "skipped": 0}
    bench_speed.report(synthetic_results(lambda i: measured if i == 0 else {"not_run": why}))
    out = capsys.readouterr().out
    wall, notes = table(out, "| shape | B x T |")
    lora, full = wall[("bench-tiny", "lora", 2)], wall[("bench-tiny", "full", 2)]
    assert lora["qtune bf16 tok/s"] == "800.0"
    assert lora["bf16 / PyTorch fp32"] == "3.20" and lora["bf16 / qtune fp32"] == "1.60"
    # 200 GFLOP/step x 800 tok/s / 1024 tok = 156.25 GFLOP/s of the 400 GFLOP/s bf16 peak
    assert lora["bf16 % of bf16 (oneDNN) peak"] == "39% of 400.0"
    assert lora["qtune tok/s"] == "500.0" and lora["qtune / PyTorch"] == "2.00"  # fp32 columns unchanged
    for col in ("qtune bf16 tok/s", "bf16 / PyTorch fp32", "bf16 / qtune fp32", "bf16 % of bf16 (oneDNN) peak"):
        assert full[col] == "-", col
    assert notes == ['bf16 columns "-" in bench-tiny full t2: ' + why,
                     "issue 7's target, qtune bf16 >= 1.5x PyTorch fp32 (tok/s): met in 1 of 1 cases"]
    assert "no AVX512_BF16" in why
    cpu, notes = table(out, "| shape | mode | threads | qtune CPU s/step")
    lora, full = cpu[("bench-tiny", "lora", 2)], cpu[("bench-tiny", "full", 2)]
    assert lora["qtune bf16 CPU s/step"] == "2.50"
    assert lora["bf16 / PyTorch fp32 (speed)"] == "3.60" and lora["bf16 / qtune fp32 (speed)"] == "1.60"
    assert full["qtune bf16 CPU s/step"] == "-" and full["bf16 / PyTorch fp32 (speed)"] == "-"
    assert notes[0] == 'bf16 columns "-" in bench-tiny full t2: ' + why
    assert notes[1].endswith("(CPU s/step): met in 1 of 1 cases")


def test_report_peak_is_the_better_library(capsys):
    """The peak table shows OpenBLAS's and oneDNN's square sgemm and uses the
    better one (gemm_peak's "peak_lib"); "% of sgemm peak" divides by it, "% of OpenBLAS sgemm peak" by
    OpenBLAS's alone (issue 7's literal yardstick)."""
    res = synthetic_results()
    res["peak"]["2"]["sgemm"] = [{"M": 1024, "gflops": 140.0, "lib": "openblas"},
                                 {"M": 2048, "gflops": 150.0, "lib": "openblas"},
                                 {"M": 1024, "gflops": 145.0, "lib": "onednn"},
                                 {"M": 2048, "gflops": 160.0, "lib": "onednn"}]
    res["peak"]["2"].update(peak_gflops=160.0, peak_lib="onednn")
    bench_speed.report(res)
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith("| threads | sgemm 1024"))
    head = [x.strip() for x in lines[i].strip("|").split("|")]
    row = dict(zip(head, [x.strip() for x in lines[i + 2].strip("|").split("|")]))
    assert (row["sgemm 2048 GFLOP/s"], row["oneDNN sgemm 2048"], row["peak used"]) == ("150.0", "160.0",
                                                                                       "160.0 (onednn)")
    wall, _ = table(out, "| shape | B x T |")
    # 200 GFLOP/step x 500 tok/s / 1024 tok = 97.7 GFLOP/s = 61% of 160
    assert wall[("bench-tiny", "lora", 2)]["% of sgemm peak"] == "61%"
    assert wall[("bench-tiny", "lora", 2)]["% of OpenBLAS sgemm peak"] == "65%"  # 97.7 / 150


def test_report_bf16_failure_names_the_error(capsys):
    err = "qtune: error: job.json: model: bf16 is enabled in the deepspeed config but this CPU has no AVX512_BF16"
    bench_speed.report(synthetic_results(lambda i: {"error": err, "rc": 1}))
    wall, notes = table(capsys.readouterr().out, "| shape | B x T |")
    assert wall[("bench-tiny", "lora", 2)]["qtune bf16 tok/s"] == "-"
    assert notes == ['bf16 columns "-" in every case: failed: ' + err]


def test_report_ab_against_the_baseline(capsys):
    """--baseline's table: the wall-clock ratio of medians and its >= 0.97 verdict, CPU s/step of each side with
    baseline / new as a speed ratio, the load range over the runs; a JSON case written before the CPU columns
    shows "-" there, a failed baseline run its error."""
    res = synthetic_results()
    res["cases"][0]["ab"] = {"new": [300.0, 250.0, 350.0], "base": [310.0, 320.0, 200.0], "ratio": 300.0 / 310.0,
                             "new_cpu": [3.0, 3.5, 2.9], "base_cpu": [3.2, 3.0, 3.1], "cpu_ratio": 3.1 / 3.0,
                             "loads": ["8.43 5.40 2.76", "11.15 8.9 5.5", "2.5 2 1", "9 9 9", "3 3 3", "4 4 4"]}
    res["cases"][1]["ab"] = {"new": [100.0], "base": [100.0], "ratio": 1.0}
    extra = dict(res["cases"][0], mode="lora", threads=1, ab={"error": "/x/qtune: exit 1"})
    res["cases"].append(extra)
    bench_speed.report(res)
    out = capsys.readouterr().out
    rows, _ = table(out, "| shape | mode | threads | new tok/s (runs)")
    lora = rows[("bench-tiny", "lora", 2)]
    assert lora["new tok/s (runs)"] == "300.0 (300.0, 250.0, 350.0)"
    assert lora["baseline tok/s (runs)"] == "310.0 (310.0, 320.0, 200.0)"
    assert lora["new / baseline"] == "0.968" and lora[">= 0.97"] == "**no**"
    assert lora["CPU s/step new / baseline (medians)"] == "3.000 / 3.100"
    assert lora["baseline / new CPU s"] == "1.033"
    assert lora["load after the runs"] == "2.5-11.15"
    full = rows[("bench-tiny", "full", 2)]
    assert full["new / baseline"] == "1.000" and full[">= 0.97"] == "yes"
    assert full["CPU s/step new / baseline (medians)"] == "-" and full["baseline / new CPU s"] == "-"
    assert rows[("bench-tiny", "lora", 1)]["new tok/s (runs)"] == "/x/qtune: exit 1"


@pytest.mark.parametrize("path", ["synthetic", "bench/runs/2026-12-02-H.json"])
def test_report_of_json_without_bf16(tmp_path, path):
    """--report of a JSON file written before the bf16 runs: the tables print
    with "-" in the bf16 columns and say why."""
    if path == "synthetic":
        f = tmp_path / "old.json"
        f.write_text(json.dumps(synthetic_results()))
    else:
        f = os.path.join(SRC, path)
    r = subprocess.run([sys.executable, os.path.join(SRC, "bench", "bench_speed.py"), "--report", str(f), "--work",
                        str(tmp_path / "work")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for first in ("| shape | B x T |", "| shape | mode | threads | qtune CPU s/step"):
        rows, notes = table(r.stdout, first)
        assert rows
        for row in rows.values():
            assert [v for k, v in row.items() if k.startswith(("qtune bf16", "bf16"))] == ["-"] * (
                4 if first.startswith("| shape | B") else 3)
        assert notes == ['bf16 columns "-" in every case: not measured: this JSON file predates the bf16 runs']


def test_bf16_plan():
    cpu_bf16 = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
    cpu_none = "flags\t\t: fpu avx2 avx512f avx512bw\n"
    assert bench_speed.bf16_plan("auto", cpu_bf16) == (True, None)
    run, why = bench_speed.bf16_plan("auto", cpu_none)
    assert not run and "no AVX512_BF16" in why
    assert bench_speed.bf16_plan("on", cpu_none) == (True, None)
    run, why = bench_speed.bf16_plan("off", cpu_bf16)
    assert not run and "--bf16 off" in why


def test_build_isa(tmp_path):
    """--isa avx2 records how the qtune it runs was compiled (the emulation is only faithful without -march=native)."""
    assert bench_speed.build_isa(str(tmp_path)) == "?"  # no CMakeCache.txt
    (tmp_path / "CMakeCache.txt").write_text("CMAKE_BUILD_TYPE:STRING=Release\nQTUNE_NATIVE:BOOL=OFF\n")
    assert "QTUNE_NATIVE=OFF" in bench_speed.build_isa(str(tmp_path))
    (tmp_path / "CMakeCache.txt").write_text("QTUNE_NATIVE:BOOL=ON\n")
    assert bench_speed.build_isa(str(tmp_path)) == "-march=native"


def test_bench_decode_steps_decodes_as_generate(tmp_path):
    """bench_decode_steps (bench_decode.py's second measure) runs the greedy
    one-token steps qtune generate runs: its ids for its seeded prompt are
    generate's, at 1 and 2 threads; its figures are positive and ordered;
    a missing --model or --bytes is refused with exit 2."""
    steps = os.path.join(BUILD, "bench", "bench_decode_steps")
    need(steps, QTUNE)
    m = str(tmp_path / "m")
    subprocess.run([QTUNE, "init", "--out", m, "--preset", "bench-tiny", "--seed", "4"], check=True,
                   capture_output=True)
    for t in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS="1")
        r = subprocess.run([steps, "--model", m, "--bytes", "1000000", "--steps", "7", "--prompt", "5",
                            "--triad-mib", "1", "--seed", "9"], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        o = json.loads(r.stdout)
        assert o["steps"] == 7 and o["threads"] == int(t) and len(o["prompt_ids"]) == 5 and len(o["ids"]) == 8
        assert o["step_ms_median"] > 0 and o["triad_gbs_median"] > 0
        assert 0 < o["pct_of_triad_q1"] <= o["pct_of_triad_median"] <= o["pct_of_triad_q3"]
        g = subprocess.run([QTUNE, "generate", "--model", m, "--prompt-ids", ",".join(map(str, o["prompt_ids"])),
                            "--max-new", "8", "--temperature", "0", "--json"], capture_output=True, text=True,
                           env=env)
        assert g.returncode == 0, g.stderr
        assert json.loads(g.stdout.strip().splitlines()[-1])["ids"] == o["ids"]
    for args in ([], ["--model", m], ["--bytes", "5"], ["--model", m, "--bytes", "0"]):
        r = subprocess.run([steps] + args, capture_output=True, text=True, env=ENV1)
        assert r.returncode == 2 and "bench_decode_steps" in r.stderr
