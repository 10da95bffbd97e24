"""The output folder: metrics.jsonl fields, loss.svg, checkpoint pruning, the
PEFT adapter's format, exact resume, SIGINT, SIGKILL during a checkpoint
write, the output-folder guard, NaN stops."""
import json
import os
import shutil
import signal
import subprocess
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from trainutil import QTUNE, env, init_model, metrics, optimizer_state, run, st, step_lines, write_job, write_tokens

FIELDS = ["step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens", "tokens_per_s", "elapsed_s",
          "mem_peak_bytes", "target_tokens", "epoch", "opt_state_bytes", "comm_s"]
LORA = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("base"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    write_tokens(os.path.join(d, "eval.jsonl"), 8, 16, seed=2)
    return d


def job(base, name, out, **kw):
    kw.setdefault("ds", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                         "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    return write_job(os.path.join(base, name), "model", out, "train.jsonl", **kw)


def test_lora_outputs(base):
    j = job(base, "outputs.json", "run_outputs", eval_="eval.jsonl", lora=LORA,
            train_opts={"max_steps": 6, "save_steps": 2, "save_total_limit": 2, "eval_steps": 3},
            data_opts={"shuffle": True})
    p = run("train", j)
    out = os.path.join(base, "run_outputs")
    assert "adapter:" in p.stdout
    lines = metrics(out)
    steps = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 7))
    for m in steps:
        for f in FIELDS:
            assert f in m, f
        assert m["mem_peak_bytes"] > 1 << 20 and m["tokens"] == 2 * 2 * 16 and m["loss_scale"] == 1
        assert m["grad_norm"] > 0 and np.isfinite(m["loss"])
    assert [m["step"] for m in evals] == [0, 3, 6]
    # loss.svg: well-formed, self-contained, two curves
    root = ET.parse(os.path.join(out, "loss.svg")).getroot()
    assert root.tag.endswith("svg")
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == 2
    assert "href" not in open(os.path.join(out, "loss.svg")).read()
    # save_total_limit 2 keeps the newest two
    assert sorted(x for x in os.listdir(out) if x.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-6"]
    # final/ is a PEFT adapter
    cfg = json.load(open(os.path.join(out, "final", "adapter_config.json")))
    for k, v in {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "lora_dropout": 0.1, "bias": "none",
                 "task_type": "CAUSAL_LM", "use_rslora": False, "fan_in_fan_out": False,
                 "inference_mode": True}.items():
        assert cfg[k] == v, k
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    assert cfg["base_model_name_or_path"].endswith("model")
    w = st.read(os.path.join(out, "final", "adapter_model.safetensors"))
    assert len(w) == 2 * 2 * 2  # layers x modules x {A, B}
    assert w["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert w["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)
    assert w["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, 4)
    assert np.abs(w["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]).max() > 0


@pytest.mark.parametrize("mode", ["lora", "full", "lora_fp16"])
def test_resume_is_exact(base, mode):
    """10 steps + resume + 10 == 20 straight, bit for bit (dropout and shuffling
    on for LoRA; with fp16 the loss scale grows every 3 steps across the resume)."""
    kw = dict(lora=LORA) if mode.startswith("lora") else {}
    if mode == "lora_fp16":
        kw["ds"] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                    "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3}}
    kw["data_opts"] = {"shuffle": True}
    a = job(base, "straight_%s.json" % mode, "straight_%s" % mode, train_opts={"max_steps": 20}, **kw)
    b = job(base, "resumed_%s.json" % mode, "resumed_%s" % mode, train_opts={"max_steps": 20, "save_steps": 4},
            **kw)
    run("train", a)
    run("train", b, "--set", "train.max_steps=10")
    p = run("train", b)
    assert "resuming from" in p.stderr and "checkpoint-10" in p.stderr
    fa, fb = (os.path.join(base, x, "final") for x in ("straight_%s" % mode, "resumed_%s" % mode))
    name = "adapter_model.safetensors" if mode.startswith("lora") else "model.safetensors"
    wa, wb = st.read(os.path.join(fa, name)), st.read(os.path.join(fb, name))
    assert set(wa) == set(wb)
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), k
    la = [(m["step"], m["loss"], m["grad_norm"], m["loss_scale"])
          for m in step_lines(os.path.join(base, "straight_%s" % mode))]
    lb = [(m["step"], m["loss"], m["grad_norm"], m["loss_scale"])
          for m in step_lines(os.path.join(base, "resumed_%s" % mode))]
    if mode == "lora_fp16":
        assert la[-1][3] > la[0][3]  # the scale grew during the run
    assert la == lb  # metrics.jsonl lists every step once, with the same values


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_saves_and_exits_130(base, sig):
    name = "run_sig%d" % int(sig)
    j = job(base, name + ".json", name, lora=LORA, train_opts={"max_steps": 100000})
    out = os.path.join(base, name)
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    mpath = os.path.join(out, "metrics.jsonl")
    t0 = time.time()
    while time.time() - t0 < 120:
        if os.path.exists(mpath) and len(open(mpath).readlines()) >= 3:
            break
        time.sleep(0.05)
    p.send_signal(sig)
    so, se = p.communicate(timeout=120)
    assert p.returncode == 130, se
    last = step_lines(out)[-1]["step"]
    ck = os.path.join(out, "checkpoint-%d" % last)
    assert os.path.exists(os.path.join(ck, "trainer_state.json")), os.listdir(out)
    assert "checkpoint-%d" % last in se and "stopped at step" in se
    # the same command continues from there
    run("train", j, "--set", "train.max_steps=%d" % (last + 2))
    assert [m["step"] for m in step_lines(out)] == list(range(1, last + 3))


def complete_checkpoints(out):
    """Every checkpoint-N folder (not .tmp) must be whole and readable."""
    found = []
    for name in os.listdir(out):
        if not name.startswith("checkpoint-") or name.endswith(".tmp"):
            continue
        ck = os.path.join(out, name)
        state = json.load(open(os.path.join(ck, "trainer_state.json")))
        assert state["step"] == int(name.split("-")[1])
        st.read(os.path.join(ck, "model.safetensors"))
        opt = optimizer_state(ck)
        assert opt["exp_avg"].shape == (state["numel"],)
        found.append(state["step"])
    return sorted(found)


def test_sigkill_during_checkpoint_keeps_previous(base):
    j = job(base, "sigkill.json", "run_sigkill", train_opts={"max_steps": 100000, "save_steps": 1,
                                                             "save_total_limit": 2})
    out = os.path.join(base, "run_sigkill")
    caught = False
    for attempt in range(3):
        p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
        t0 = time.time()
        seen_complete = False
        while time.time() - t0 < 60 and p.poll() is None:
            names = os.listdir(out) if os.path.isdir(out) else []
            done = [n for n in names if n.startswith("checkpoint-") and not n.endswith(".tmp")]
            if done:
                seen_complete = True
            if seen_complete and any(n.endswith(".tmp") and n.startswith("checkpoint-") for n in names):
                p.kill()  # SIGKILL while a checkpoint is being written
                caught = True
                break
        if p.poll() is None:
            p.kill()
        p.wait()
        if caught:
            break
    assert caught, "never saw a checkpoint being written"
    steps = complete_checkpoints(out)
    assert steps, "the previous checkpoint must survive"
    # the next run resumes from the newest complete one and cleans the .tmp up
    run("train", j, "--set", "train.max_steps=%d" % (steps[-1] + 1))
    names = os.listdir(out)
    assert not any(n.endswith(".tmp") for n in names), names
    assert step_lines(out)[-1]["step"] == steps[-1] + 1


def test_output_dir_refuses_another_run(base):
    j1 = job(base, "guard1.json", "run_guard", lora=LORA, train_opts={"max_steps": 1})
    run("train", j1)
    lora2 = dict(LORA, r=8)
    j2 = job(base, "guard2.json", "run_guard", lora=lora2, train_opts={"max_steps": 1})
    p = run("train", j2, check=False)
    assert p.returncode == 1
    assert "run_guard" in p.stderr and "overwrite_output_dir" in p.stderr
    # nothing of the first run was touched
    assert json.load(open(os.path.join(base, "run_guard", "final", "adapter_config.json")))["r"] == 4
    run("train", j2, "--set", "train.overwrite_output_dir=true")
    assert json.load(open(os.path.join(base, "run_guard", "final", "adapter_config.json")))["r"] == 8
    # a folder with files no qtune run wrote
    os.makedirs(os.path.join(base, "foreign"))
    open(os.path.join(base, "foreign", "notes.txt"), "w").write("mine")
    j3 = job(base, "guard3.json", "foreign", lora=LORA, train_opts={"max_steps": 1})
    p = run("train", j3, check=False)
    assert p.returncode == 1 and "no qtune run wrote" in p.stderr
    run("train", j3, "--set", "train.overwrite_output_dir=true")
    assert open(os.path.join(base, "foreign", "notes.txt")).read() == "mine"  # only qtune's outputs are replaced


def test_output_dir_in_use_is_refused(base):
    """A second qtune on a folder a running one holds is refused at once, naming the first process, and
    removes nothing: not even with overwrite_output_dir, which would otherwise delete the first run's
    checkpoints under it (before the lock, two runs of the same job renamed each other's checkpoint files
    away mid-write). The first run then finishes intact, and the folder is free again."""
    j = job(base, "busy.json", "run_busy", train_opts={"max_steps": 100000, "save_steps": 2})
    out = os.path.join(base, "run_busy")
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    mpath = os.path.join(out, "metrics.jsonl")
    t0 = time.time()
    while time.time() - t0 < 120 and not (os.path.exists(mpath) and len(open(mpath).readlines()) >= 3):
        time.sleep(0.05)
    assert p.poll() is None
    for extra in ([], ["--set", "train.overwrite_output_dir=true"], ["--set", "train.resume=never"]):
        second = run("train", j, *extra, check=False)
        assert second.returncode == 1, second.stderr
        assert "in use by another qtune process" in second.stderr and "process %d on " % p.pid in second.stderr, \
            second.stderr
        assert p.poll() is None
    p.send_signal(signal.SIGINT)
    so, se = p.communicate(timeout=120)
    assert p.returncode == 130, se
    assert complete_checkpoints(out)
    steps = [m["step"] for m in step_lines(out)]
    assert steps == list(range(1, len(steps) + 1))  # one run's lines, none lost or doubled
    run("train", j, "--set", "train.max_steps=%d" % (steps[-1] + 1))  # released: the same job resumes


def test_nan_stops_naming_step_and_checkpoint(base):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e30}}}
    j = job(base, "nan.json", "run_nan", train_opts={"max_steps": 50, "save_steps": 1}, ds=ds)
    p = run("train", j, check=False)
    assert p.returncode == 1, p.stderr
    assert "not finite" in p.stderr and "step " in p.stderr and "checkpoint-" in p.stderr


def test_bad_job_fields_are_named(base):
    j = job(base, "bad.json", "run_bad", train_opts={"max_steps": "ten"})
    p = run("train", j, check=False)
    assert p.returncode == 1 and "train.max_steps" in p.stderr and "bad.json" in p.stderr
    j = job(base, "bad2.json", "run_bad", lora=dict(LORA, target_modules=["qq_proj"]))
    p = run("train", j, check=False)
    assert p.returncode == 1 and "qq_proj" in p.stderr
    j = job(base, "typo.json", "run_typo", train_opts={"max_step": 3, "max_steps": 1})
    p = run("train", j)
    assert "max_step'" in p.stderr  # unknown keys are named in a warning
    p = run("train", j, "--set", "train.max_steps=abc", check=False)
    assert p.returncode == 1 and "--set train.max_steps=abc" in p.stderr


def test_fp16_overflow_skips_then_stops_at_the_floor(base):
    """fp16: an overflowing step is skipped (no update), the scale backs off by
    DeepSpeed's rules (hysteresis 2), and at min_loss_scale the run stops
    naming the step and the last good checkpoint."""
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e30}},
          "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 3, "hysteresis": 2}}
    j = job(base, "fp16.json", "run_fp16", train_opts={"max_steps": 30, "save_steps": 1}, ds=ds)
    p = run("train", j, check=False)
    assert p.returncode == 1
    assert "min_loss_scale" in p.stderr and "last good checkpoint is" in p.stderr and "checkpoint-" in p.stderr
    lines = step_lines(os.path.join(base, "run_fp16"))
    assert not lines[0]["skipped"] and lines[0]["loss_scale"] == 8
    skipped = [m for m in lines if m["skipped"]]
    assert [m["loss_scale"] for m in skipped] == [8, 8, 4, 2, 1][:len(skipped)] and len(skipped) >= 4
    assert all(m["loss"] is None for m in skipped)
    # skipped steps changed nothing: the newest checkpoint holds step 1's weights
    w1 = st.read(os.path.join(base, "run_fp16", "checkpoint-1", "model.safetensors"))
    last = sorted(int(n.split("-")[1]) for n in os.listdir(os.path.join(base, "run_fp16"))
                  if n.startswith("checkpoint-") and not n.endswith(".tmp"))[-1]
    wl = st.read(os.path.join(base, "run_fp16", "checkpoint-%d" % last, "model.safetensors"))
    for k in w1:
        assert np.array_equal(w1[k], wl[k]), k


def test_final_model_is_a_hard_link_to_the_last_checkpoint(base):
    """Full fine-tuning of an fp32 model: final/model.safetensors is the last
    checkpoint's file (same inode), not a second copy; deleting the checkpoint
    (by hand, or by save_total_limit's rotation on a later run) leaves final/
    whole, since qtune never rewrites a file in place."""
    j = job(base, "hardlink.json", "run_hardlink", train_opts={"max_steps": 2, "save_steps": 1,
                                                               "save_total_limit": 1})
    run("train", j)
    out = os.path.join(base, "run_hardlink")
    fin, ck = os.path.join(out, "final", "model.safetensors"), os.path.join(out, "checkpoint-2", "model.safetensors")
    a, b = os.stat(fin), os.stat(ck)
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev) and a.st_nlink == 2
    # the same bytes as a written final/ would hold: fp32 tensors by HF names, loadable
    w = st.read(fin)
    assert all(v.dtype == np.float32 for v in w.values())
    data = open(fin, "rb").read()
    # a resumed, longer run: rotation removes checkpoint-2 (save_total_limit 1)
    # while a copy of the old final/ is kept under another name to watch
    keep = os.path.join(base, "hardlink_old_final.safetensors")
    if os.path.exists(keep):
        os.remove(keep)
    os.link(fin, keep)
    run("train", j, "--set", "train.max_steps=3")
    assert not os.path.exists(ck) and os.path.exists(os.path.join(out, "checkpoint-3"))
    assert open(keep, "rb").read() == data
    a, b = os.stat(fin), os.stat(os.path.join(out, "checkpoint-3", "model.safetensors"))
    assert a.st_ino == b.st_ino
    # deleting the checkpoint by hand leaves final/ as it was
    data3 = open(fin, "rb").read()
    shutil.rmtree(os.path.join(out, "checkpoint-3"))
    assert os.stat(fin).st_nlink == 1 and open(fin, "rb").read() == data3
    st.read(fin)


def test_final_model_in_another_dtype_is_written(tmp_path):
    """A bf16 model's final/model.safetensors is bf16, so it cannot be the
    checkpoint's fp32 file: it is written, not linked."""
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), dtype="bf16")
    write_tokens(os.path.join(d, "train.jsonl"), 16, 16, seed=1)
    j = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", train_opts={"max_steps": 1})
    run("train", j)
    fin = os.path.join(d, "out", "final", "model.safetensors")
    assert os.stat(fin).st_nlink == 1
    assert set(st.read_dtypes(fin).values()) == {"BF16"}
