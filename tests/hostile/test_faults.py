"""Faults during training (docs/robustness.md): signals, a full disk during a
checkpoint, numerical blow-ups, and files from another run. tests/train/
already covers SIGINT -> 130, SIGKILL in the middle of a checkpoint write,
the output-folder guard and a diverging learning rate; these add SIGTERM,
ENOSPC/EFBIG while saving, a NaN in the model file, and resume mismatches."""
import json
import os
import resource
import signal
import subprocess
import time

import pytest

from hostile_util import QTUNE, env, expect_error, ok, run, write, write_job, write_tokens

LORA = {"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    write_tokens(d / "tokens.jsonl", n=16)
    return d


def complete_checkpoints(out):
    import st
    found = []
    for name in sorted(os.listdir(out)):
        if not name.startswith("checkpoint-") or name.endswith(".tmp"):
            continue
        ck = os.path.join(out, name)
        state = json.load(open(os.path.join(ck, "trainer_state.json")))
        assert state["step"] == int(name.split("-")[1])
        for p in state["optimizer"]["parts"]:
            st.read(os.path.join(ck, p["file"]))
        w = "adapter_model.safetensors" if state["lora"] else "model.safetensors"
        st.read(os.path.join(ck, w))
        found.append(state["step"])
    return sorted(found)


def metric_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l)["step"] for l in f if l.strip() and "loss" in json.loads(l)]


def wait_for_steps(path, n, p, limit=120):
    t0 = time.time()
    while time.time() - t0 < limit and p.poll() is None:
        if os.path.exists(path) and len(open(path).readlines()) >= n:
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------------------
# signals

def test_sigterm_saves_and_exits_130(base):
    j = write_job(base / "term.json", "model", "out_term", "tokens.jsonl", lora=LORA,
                  train_opts={"max_steps": 100000, "save_steps": 0})
    out = base / "out_term"
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert wait_for_steps(out / "metrics.jsonl", 3, p)
    p.send_signal(signal.SIGTERM)
    _, se = p.communicate(timeout=120)
    assert p.returncode == 130, se
    steps = complete_checkpoints(out)
    last = metric_steps(out)[-1]
    assert steps == [last], (steps, last)  # save_steps 0: the only checkpoint is the one the signal asked for
    assert "checkpoint-%d" % last in se
    # the same command continues; metrics list every step once
    ok(["train", j, "--set", "train.max_steps=%d" % (last + 2)])
    assert metric_steps(out) == list(range(1, last + 3))


def test_second_signal_during_the_save_still_leaves_a_whole_checkpoint(base):
    """SIGINT then SIGTERM right after: the run still ends with status 130 and
    a complete checkpoint (the handler only sets a flag)."""
    j = write_job(base / "term2.json", "model", "out_term2", "tokens.jsonl",
                  train_opts={"max_steps": 100000, "save_steps": 0})
    out = base / "out_term2"
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert wait_for_steps(out / "metrics.jsonl", 2, p)
    p.send_signal(signal.SIGINT)
    time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    _, se = p.communicate(timeout=120)
    assert p.returncode == 130, se
    assert complete_checkpoints(out)
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


# ---------------------------------------------------------------------------
# a full disk while saving

def _no_sigxfsz_limit(nbytes):
    def f():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return f


def test_file_size_limit_during_checkpoint_keeps_the_previous_one(base):
    """RLIMIT_FSIZE (SIGXFSZ ignored) makes the checkpoint's weight file fail
    with EFBIG: the error names the file, the exit is 1, checkpoint-1 stays
    whole, no half checkpoint is left, and the next run resumes from it."""
    j = write_job(base / "fsize.json", "model", "out_fsize", "tokens.jsonl",
                  train_opts={"max_steps": 1, "save_steps": 1})
    out = base / "out_fsize"
    ok(["train", j])
    assert complete_checkpoints(out) == [1]
    before = open(out / "checkpoint-1" / "model.safetensors", "rb").read()
    p = subprocess.run([QTUNE, "train", j, "--set", "train.max_steps=3"], capture_output=True, text=True, env=env(),
                       preexec_fn=_no_sigxfsz_limit(128 << 10), timeout=300)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "safetensors" in p.stderr and ("too large" in p.stderr.lower() or "cannot write" in p.stderr.lower()
                                          or "no space" in p.stderr.lower()), p.stderr
    assert complete_checkpoints(out) == [1]
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")], os.listdir(out)
    assert open(out / "checkpoint-1" / "model.safetensors", "rb").read() == before
    ok(["train", j, "--set", "train.max_steps=3"])
    assert metric_steps(out) == [1, 2, 3]
    assert complete_checkpoints(out)[-1] == 3


@pytest.fixture
def tmpfs(tmp_path):
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): %s" % r.stderr.decode().strip())
    yield d
    subprocess.run(["umount", "-l", str(d)])


def test_full_disk_during_checkpoint_keeps_the_previous_one(base, tmpfs):
    """A real ENOSPC: the output folder on a 2.6 MB tmpfs holds checkpoint-1
    (about 1.5 MB for the tiny model's full fine-tuning) but not checkpoint-2."""
    out = tmpfs / "out"
    j = write_job(base / "enospc.json", "model", str(out), "tokens.jsonl",
                  train_opts={"max_steps": 4, "save_steps": 1})
    p = run(["train", j])
    assert p.returncode == 1, p
    assert "space" in p.stderr.lower() or "cannot write" in p.stderr.lower(), p
    steps = complete_checkpoints(out)
    assert steps and steps[-1] < 4, steps
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")], os.listdir(out)
    # more room: the same command resumes from the newest complete checkpoint and finishes
    subprocess.run(["mount", "-o", "remount,size=16m", str(tmpfs)], check=True)
    ok(["train", j])
    assert metric_steps(out) == [1, 2, 3, 4]
    assert os.path.exists(out / "final" / "model.safetensors")


# ---------------------------------------------------------------------------
# numerical faults

def test_nan_in_the_model_file_stops_naming_step_rank_and_checkpoint(base):
    """A LoRA run on a base whose weights turn NaN after checkpoint-2: step 3
    stops the run with a sentence naming the step, the rank and checkpoint-2."""
    import numpy as np
    import shutil
    import st
    shutil.copytree(base / "model", base / "model_nan")
    j = write_job(base / "nan.json", "model_nan", "out_nan", "tokens.jsonl", lora=LORA,
                  train_opts={"max_steps": 2, "save_steps": 1})
    ok(["train", j])
    w = st.read(str(base / "model_nan" / "model.safetensors"))
    k = sorted(n for n in w if n.endswith("input_layernorm.weight"))[0]
    w[k] = w[k].copy()
    w[k][3] = np.nan
    st.write(str(base / "model_nan" / "model.safetensors"), w)
    r = expect_error(["train", j, "--set", "train.max_steps=5"], "step 3", "rank 0", "checkpoint-2", "not finite")
    assert complete_checkpoints(base / "out_nan") == [1, 2]
    # a model that is NaN from the start: no checkpoint to name, and it says so
    j2 = write_job(base / "nan2.json", "model_nan", "out_nan2", "tokens.jsonl", lora=LORA,
                   train_opts={"max_steps": 2, "save_steps": 1})
    expect_error(["train", j2], "step 1", "not finite", "no checkpoint")
    assert not os.path.exists(base / "out_nan2" / "checkpoint-1")
    assert r.returncode == 1


def test_huge_learning_rate_diverges_and_stops(base):
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e30}}}
    j = write_job(base / "lr.json", "model", "out_lr", "tokens.jsonl", train_opts={"max_steps": 30, "save_steps": 1},
                  ds=ds)
    r = expect_error(["train", j], "not finite", "rank 0", re_step := "step ")
    m = [x for x in metric_steps(base / "out_lr")]
    # every checkpoint left behind is a good one (written before the blow-up)
    for s in complete_checkpoints(base / "out_lr"):
        assert s in m
    assert re_step in r.stderr


# ---------------------------------------------------------------------------
# files of another run

def test_resume_from_another_jobs_checkpoint_says_what_differs(base):
    j1 = write_job(base / "rj1.json", "model", "out_rj1", "tokens.jsonl", lora=LORA,
                   train_opts={"max_steps": 1, "save_steps": 1})
    ok(["train", j1])
    ck = str(base / "out_rj1" / "checkpoint-1")
    # a different trainable set (r): the shapes differ and the message gives both sizes
    j2 = write_job(base / "rj2.json", "model", "out_rj2", "tokens.jsonl", lora=dict(LORA, r=4),
                   train_opts={"max_steps": 2, "resume": ck})
    expect_error(["train", j2], "checkpoint-1", "lora.r")
    # same shapes, other modules (k_proj and v_proj have the same shape in the tiny model)
    j3 = write_job(base / "rj3.json", "model", "out_rj3", "tokens.jsonl", lora=dict(LORA, target_modules=["q_proj",
                                                                                                        "k_proj"]),
                   train_opts={"max_steps": 2, "resume": ck})
    expect_error(["train", j3], "checkpoint-1", "target_modules")
    # another model folder with the same shapes
    import shutil
    shutil.copytree(base / "model", base / "model_b")
    j4 = write_job(base / "rj4.json", "model_b", "out_rj4", "tokens.jsonl", lora=LORA,
                   train_opts={"max_steps": 2, "resume": ck})
    expect_error(["train", j4], "checkpoint-1", "model")
    # a different optimizer setting
    j5 = write_job(base / "rj5.json", "model", "out_rj5", "tokens.jsonl", lora=LORA,
                   train_opts={"max_steps": 2, "resume": ck},
                   ds={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    expect_error(["train", j5], "checkpoint-1", "deepspeed.optimizer")
    # nothing was written into the other runs' folders
    for o in ("out_rj2", "out_rj3", "out_rj4", "out_rj5"):
        assert not os.path.exists(base / o / "checkpoint-2")


def test_full_resume_into_lora_job_is_refused(base):
    j1 = write_job(base / "fl1.json", "model", "out_fl1", "tokens.jsonl", train_opts={"max_steps": 1, "save_steps": 1})
    ok(["train", j1])
    j2 = write_job(base / "fl2.json", "model", "out_fl2", "tokens.jsonl", lora=LORA,
                   train_opts={"max_steps": 2, "resume": str(base / "out_fl1" / "checkpoint-1")})
    expect_error(["train", j2], "checkpoint-1", "lora")


def test_output_dir_of_another_run_names_the_difference(base):
    j1 = write_job(base / "od1.json", "model", "out_od", "tokens.jsonl", lora=LORA, train_opts={"max_steps": 1})
    ok(["train", j1])
    j2 = write_job(base / "od2.json", "model", "out_od", "tokens.jsonl", lora=dict(LORA, lora_alpha=8),
                   train_opts={"max_steps": 1})
    expect_error(["train", j2], "out_od", "overwrite_output_dir", "lora.lora_alpha")
    # a changed run length or save cadence is the same run: it continues
    ok(["train", j1, "--set", "train.max_steps=2", "--set", "train.save_steps=1"])


SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
/* SIGKILL this process at the unlink() of a path holding both substrings */
int unlink(const char *path) {
    static int (*real)(const char *);
    if (!real) real = (int (*)(const char *))dlsym(RTLD_NEXT, "unlink");
    const char *a = getenv("SHIM_KILL_DIR"), *b = getenv("SHIM_KILL_FILE");
    if (a && b && strstr(path, a) && strstr(path, b)) raise(SIGKILL);
    return real(path);
}
"""


def test_sigkill_while_pruning_an_old_checkpoint(base, tmp_path):
    """save_total_limit removes old checkpoints; a SIGKILL in the middle of that
    removal (an LD_PRELOAD shim kills at the unlink of checkpoint-1's
    trainer_state.json, after the weights went) must not leave a checkpoint-1
    folder that has trainer_state.json but lacks files (scripts/soak found
    this; the test fails on the code before the fix), and the next run resumes
    and finishes."""
    src = tmp_path / "shim.c"
    src.write_text(SHIM)
    lib = tmp_path / "shim.so"
    r = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("no C compiler for the LD_PRELOAD shim: %s" % r.stderr)
    j = write_job(base / "prune.json", "model", "out_prune", "tokens.jsonl",
                  train_opts={"max_steps": 3, "save_steps": 1, "save_total_limit": 1})
    out = base / "out_prune"
    e = env(LD_PRELOAD=str(lib), SHIM_KILL_DIR="/checkpoint-1", SHIM_KILL_FILE="trainer_state.json")
    e.pop("ASAN_OPTIONS", None)
    if "asan" in open(QTUNE, "rb").read(200000).decode("latin-1").lower():
        pytest.skip("the shim cannot be preloaded ahead of the ASan runtime")
    p = subprocess.run([QTUNE, "train", j], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    assert 2 in complete_checkpoints(out)
    for n in os.listdir(out):
        if n.startswith("checkpoint-") and not n.endswith(".tmp"):
            # whatever survives under a checkpoint name is whole
            assert os.path.exists(out / n / "trainer_state.json"), os.listdir(out / n)
    complete_checkpoints(out)
    ok(["train", j])
    assert metric_steps(out) == [1, 2, 3]
    assert complete_checkpoints(out) == [3]
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
