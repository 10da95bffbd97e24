"""Issue 41 item 4 (fewer surprises in a run's words), one process:
- an fp16 (or bf16) section with enabled "auto" trains in fp32: a warning at
  the start, the run line and `qtune doctor` say it;
- a misspelt key names the nearest known key (job, lora, DeepSpeed), and
  --strict makes every unknown key an error (train and doctor);
- a "model" path that does not exist names the job key;
- the closing summary gives wall time, mean tokens/s and the record's paths;
- a run whose every step overflowed fp16 names the initial scale, counts the
  overflows of the run before a resume, and loss.svg marks the skipped steps.
The MPI words (warnings once, Ctrl-C on mpirun, `qtune stop`) are in
tests/dist/test_mpi_words.py."""
import json
import os
import re
import shutil
import subprocess

import pytest

from trainutil import QTUNE, env, init_model, metrics, run, write_job, write_tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("words"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    return d


def job(base, name, **kw):
    return write_job(os.path.join(base, f"{name}.json"), "model", f"run_{name}", "train.jsonl", **kw)


def test_fp16_auto_is_a_warning_in_the_run_line_and_doctor(base):
    ds = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "auto", "initial_scale_power": 12}}
    j = job(base, "fp16auto", ds=ds, train_opts={"max_steps": 1})
    p = run("train", j)
    warn = [l for l in p.stderr.splitlines() if l.startswith("qtune: warning:") and "fp16.enabled" in l]
    assert len(warn) == 1, p.stderr
    assert '"auto" -> false: this run trains in fp32, not fp16' in warn[0], warn
    assert "set fp16.enabled to true" in warn[0], warn
    line = [l for l in p.stderr.splitlines() if l.startswith("qtune: run: ")][0]
    assert 'fp32 (WARNING: fp16.enabled "auto" -> false; set it to true for fp16)' in line, line
    d = run("doctor", j, "--no-table")
    assert 'warning: ' in d.stdout and 'fp16.enabled is "auto", which qtune resolves to false: the job trains in fp32' \
        in d.stdout, d.stdout
    # no fp16 section, or one that says false: plain fp32, no warning
    j = job(base, "fp32plain", ds={"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": False}},
            train_opts={"max_steps": 1})
    p = run("train", j)
    assert "WARNING" not in p.stderr and "qtune: warning" not in p.stderr, p.stderr
    assert "| fp32 |" in [l for l in p.stderr.splitlines() if l.startswith("qtune: run: ")][0]
    d = run("doctor", j, "--no-table")
    assert "fp16.enabled" not in d.stdout, d.stdout


def test_typos_name_the_nearest_key_and_strict_refuses_them(base):
    j = job(base, "typo", lora={"r": 4, "lora_aplha": 8}, train_opts={"max_steps": 1, "gradient_checkpoint": True},
            ds={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "overlap_com": True}})
    p = run("train", j)
    err = p.stderr
    assert "unknown key 'lora.lora_aplha' is ignored; did you mean 'lora.lora_alpha'?" in err, err
    assert "unknown key 'train.gradient_checkpoint' is ignored; did you mean 'train.gradient_checkpointing'?" in err
    assert 'DeepSpeed key "zero_optimization.overlap_com" has no effect in qtune and is ignored; did you mean ' \
           '"zero_optimization.overlap_comm"?' in err, err
    # --strict: the first unknown key stops the run before anything is written, with the same sentence
    shutil.rmtree(os.path.join(base, "run_typo"))
    p = run("train", j, "--strict", check=False)
    assert p.returncode == 1, p.stderr
    assert "did you mean 'lora.lora_alpha'?" in p.stderr and "--strict" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(base, "run_typo"))
    # the DeepSpeed config's keys too, once the job's own are right
    j2 = job(base, "typo_ds", lora={"r": 4, "lora_alpha": 8}, train_opts={"max_steps": 1},
             ds={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "overlap_com": True}})
    p = run("train", j2, "--strict", check=False)
    assert p.returncode == 1 and 'did you mean "zero_optimization.overlap_comm"?' in p.stderr, p.stderr
    # doctor --strict counts it as a problem; plain doctor only warns
    d = run("doctor", j, "--no-table", "--strict", check=False)
    assert d.returncode == 1 and "did you mean 'lora.lora_alpha'?" in d.stdout, d.stdout + d.stderr
    d = run("doctor", j, "--no-table", check=False)
    assert "did you mean 'lora.lora_alpha'?" in d.stderr, d.stderr
    assert "lora_aplha" not in d.stdout, d.stdout


def test_missing_model_names_the_job_key(base):
    j = os.path.join(base, "nomodel.json")
    write_job(j, "models/not-there", "run_nomodel", "train.jsonl")
    p = run("train", j, check=False)
    assert p.returncode == 1, p.stderr
    want = f'{j}: "model" names {os.path.join(base, "models/not-there")}, which does not exist'
    assert want in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(base, "run_nomodel"))


def test_summary_gives_wall_time_speed_and_paths(base):
    j = job(base, "summary", train_opts={"max_steps": 2})
    p = run("train", j)
    out = os.path.join(base, "run_summary")
    lines = p.stdout.splitlines()
    wall = [l for l in lines if l.startswith("wall time ")]
    assert len(wall) == 1 and "tokens/s mean over this run's steps" in wall[0], p.stdout
    tokens = sum(m["tokens"] for m in metrics(out) if "loss" in m)
    assert f"({tokens} tokens in " in wall[0], (wall, tokens)
    assert f"loss curve: {out}/loss.svg" in lines, p.stdout
    assert f"metrics: {out}/metrics.jsonl" in lines, p.stdout


def test_all_skipped_fp16_names_the_initial_scale_across_a_resume(base):
    """fp16 starting at 2^60: every step overflows while the scale backs off (hysteresis 2, then a halving a
    step). The run fails without final/, saying the initial scale is why; resumed for two more steps, the
    count is of all four overflows (the optimizer's count started again at 0 before); loss.svg marks each
    skipped step."""
    ds = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 60}}
    j = job(base, "allskip", ds=ds, train_opts={"max_steps": 2, "save_steps": 2})
    p = run("train", j, check=False)
    assert p.returncode != 0, p.stderr
    assert "every one of the 2 steps was skipped (2 fp16 overflows, 0 without a labelled token)" in p.stderr
    assert "the fp16 loss scale started at 2^60" in p.stderr and "fp16.initial_scale_power" in p.stderr, p.stderr
    assert "set it to 0 (dynamic)" not in p.stderr  # the scale is dynamic already
    out = os.path.join(base, "run_allskip")
    assert not os.path.exists(os.path.join(out, "final"))
    p = run("train", j, "--set", "train.max_steps=4", check=False)
    assert p.returncode != 0, p.stderr
    assert "every one of the 4 steps was skipped (4 fp16 overflows, 0 without a labelled token)" in p.stderr, \
        p.stderr
    svg = open(os.path.join(out, "loss.svg")).read()
    for s in range(1, 5):
        assert f"<title>step {s} skipped</title>" in svg, svg
    assert "4 skipped steps (no update)" in svg
    assert [m["skipped"] for m in metrics(out) if "loss" in m] == [True] * 4


def test_summary_and_progress_give_a_slow_runs_speed_with_decimals(base):
    """A run under 10 tokens/s (a 14B QLoRA step on a CPU: 0.11) says so with two decimals; 7ffe4f9 printed
    "0 tokens/s". The step is made slow by a test fault point (QTUNE_TEST_FAULT, core/fault.h)."""
    j = job(base, "slow", train_opts={"max_steps": 1},
            ds={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    e = env()
    e["QTUNE_TEST_FAULT"] = "step-done@0#1:sleep3000"  # <= 16 tokens in > 3 s: under 6 tokens/s
    p = subprocess.run([QTUNE, "train", j], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    wall = [l for l in p.stdout.splitlines() if l.startswith("wall time ")]
    m = re.search(r"; (\d+\.\d\d) tokens/s mean", wall[0] if wall else "")
    assert m and 0 < float(m.group(1)) < 10, p.stdout
    step = re.search(r"step 1/1: .*, (\d+\.\d\d) tokens/s, ETA", p.stderr + p.stdout)
    assert step and 0 < float(step.group(1)) < 10, p.stderr
