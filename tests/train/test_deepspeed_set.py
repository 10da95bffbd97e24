"""`--set deepspeed.X=...` on a DeepSpeed file: a flag the file holds as "auto"
takes 1/0 as a flag that holds true/false does (it was refused), and a value
the reader refuses is named by its --set, in train, plan and doctor (the error
named the DeepSpeed file, which never held that value)."""
import json
import os

import pytest

from trainutil import init_model, run, write_tokens


def job_with_ds_file(d, ds, name="job.json"):
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=1)
    with open(os.path.join(d, "ds.json"), "w") as f:
        json.dump(ds, f)
    job = {"model": "model", "output_dir": "out", "data": {"train": "train.jsonl", "seq_len": 16},
           "train": {"max_steps": 1}, "deepspeed": "ds.json"}
    with open(os.path.join(d, name), "w") as f:
        json.dump(job, f)
    return os.path.join(d, name)


AUTO_DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
           "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("value,precision", [("1", "fp16"), ("true", "fp16"), ("0", "fp32")])
def test_a_flag_that_holds_auto_takes_1_and_0(tmp_path, value, precision):
    job = job_with_ds_file(str(tmp_path), AUTO_DS)
    p = run("train", job, "--set", "deepspeed.fp16.enabled=" + value, check=False)
    assert p.returncode == 0, p.stderr
    run_line = [l for l in p.stderr.splitlines() if l.startswith("qtune: run:")]
    assert run_line and "| %s" % precision in run_line[0], p.stderr


BAD = [("deepspeed.fp16.enabled=yes", '"fp16.enabled" must be true or false'),
       ("deepspeed.gradient_accumulation_steps=0", '"gradient_accumulation_steps" is 0'),
       ("deepspeed.optimizer.params.lr=-1", "lr"),
       ("deepspeed.bf16.enabled=true", "fp16.enabled and bf16.enabled are both true")]


@pytest.mark.parametrize("set_,says", BAD)
def test_a_value_the_reader_refuses_names_its_set(tmp_path, set_, says):
    ds = dict(AUTO_DS, fp16={"enabled": True})
    if set_.startswith("deepspeed.fp16") or set_.startswith("deepspeed.gradient"):
        ds = AUTO_DS
    job = job_with_ds_file(str(tmp_path), ds)
    for cmd in (["train", job], ["plan", job], ["doctor", job, "--no-table"]):
        p = run(*cmd, "--set", set_, check=False)
        assert p.returncode == 1, (cmd, p.returncode, p.stderr)
        said = p.stderr if cmd[0] != "doctor" else p.stdout
        line = [l for l in said.splitlines() if says in l]
        assert line and "--set %s: " % set_ in line[0] and "ds.json" not in line[0], (cmd, said)


def test_the_file_s_own_error_still_names_the_file(tmp_path):
    """A DeepSpeed file that was unreadable before the --set keeps its own error."""
    job = job_with_ds_file(str(tmp_path), dict(AUTO_DS, gradient_clipping="x"))
    p = run("train", job, "--set", "deepspeed.fp16.enabled=1", check=False)
    assert p.returncode == 1 and "ds.json: \"gradient_clipping\" must be a number" in p.stderr, p.stderr
    assert "--set" not in p.stderr, p.stderr


def test_the_check_says_nothing_twice(tmp_path):
    """The loader checks the DeepSpeed config around each --set without a word: the warning for an unknown
    key and the line that says what an "auto" became come once, from the run's parse."""
    job = job_with_ds_file(str(tmp_path), dict(AUTO_DS, foo=1))
    p = run("train", job, "--set", "deepspeed.fp16.enabled=1", "--set", "deepspeed.bf16.enabled=0", check=False)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count('DeepSpeed key "foo"') == 1, p.stderr
    assert p.stderr.count('gradient_accumulation_steps "auto" ->') == 1, p.stderr
