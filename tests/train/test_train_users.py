"""Issue 22 (meet users where they are), at the CLI: a run says what it
resolved (each DeepSpeed "auto", then one line with precision, ZeRO, optimizer,
schedule, checkpointing, batch and device)."""
import json
import os
import shutil
import subprocess

import pytest

from trainutil import QTUNE, env, init_model, run, write_job, write_tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("users"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    return d


def test_run_says_what_it_resolved(base):
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 1}}
    j = write_job(os.path.join(base, "resolved.json"), "model", "run_resolved", "train.jsonl", ds=ds,
                  lora={"r": 4, "lora_alpha": 8}, train_opts={"max_steps": 3, "gradient_checkpointing": True})
    p = run("train", j)
    err = p.stderr.splitlines()
    says = [l for l in err if '"auto" ->' in l]
    assert any("train_micro_batch_size_per_gpu \"auto\" -> 1 (" in l for l in says), p.stderr
    assert any("gradient_accumulation_steps \"auto\" -> 4 (train_batch_size 4 / micro-batch 1 / 1 rank(s))" in l
               for l in says), p.stderr
    assert any("fp16.enabled \"auto\" -> false" in l for l in says), p.stderr
    assert any("optimizer.params.lr \"auto\" -> 5e-05" in l for l in says), p.stderr
    assert any("total_num_steps \"auto\" -> 3 (train.max_steps)" in l for l in says), p.stderr
    assert len(says) == 5, p.stderr  # one line per "auto", each once
    runs = [l for l in err if l.startswith("qtune: run: ")]
    assert len(runs) == 1, p.stderr
    line = runs[0]
    for part in ["LoRA r 4", "fp32", "ZeRO stage 1, no offload", "AdamW lr 5e-05", "WarmupCosineLR",
                 "gradient checkpointing on", "micro-batch 1 x accumulation 4 x 1 rank(s) = 4 rows of 16 tokens",
                 "device cpu, 1 thread(s)"]:
        assert part in line, line
    # it comes before the first step is reported
    assert err.index(line) < min(i for i, l in enumerate(err) if "step 1/3" in l or "step 3/3" in l)


def test_adapter_names_its_base_absolutely(base):
    """base_model_name_or_path is the model folder's absolute path, not the job-relative "model"."""
    j = write_job(os.path.join(base, "absbase.json"), "model", "run_absbase", "train.jsonl",
                  lora={"r": 2}, train_opts={"max_steps": 1})
    run("train", j)
    with open(os.path.join(base, "run_absbase", "final", "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["base_model_name_or_path"] == os.path.realpath(os.path.join(base, "model"))


def test_misspelled_keys_get_the_near_spelling(base):
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_acumulation_steps": 2,
          "activation_checkpointing": {"partition_activations": True},
          "zero_optimization": {"stage": 0, "overlap_com": True}, "tensorboard": {"enabled": False}}
    j = write_job(os.path.join(base, "spell.json"), "model", "run_spell", "train.jsonl", ds=ds,
                  train_opts={"max_step": 3})
    p = run("doctor", j, "--no-table", check=False)
    err = p.stderr
    assert "'train.max_step' is ignored; did you mean 'train.max_steps'?" in err, err
    assert '"gradient_acumulation_steps" has no effect in qtune and is ignored; did you mean ' \
           '"gradient_accumulation_steps"?' in err, err
    assert '"zero_optimization.overlap_com" has no effect in qtune and is ignored; did you mean ' \
           '"zero_optimization.overlap_comm"?' in err, err
    assert '"activation_checkpointing" has no effect in qtune and is ignored; set the job\'s ' \
           'train.gradient_checkpointing to true' in err, err
    line = [l for l in err.splitlines() if '"tensorboard"' in l][0]
    assert "did you mean" not in line  # nothing near: no guess


MPIRUN = shutil.which("mpirun")
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed")
@pytest.mark.parametrize("case", ["deepspeed", "model"])
def test_mpi_start_error_is_said_once(base, case):
    """Every rank hits the same bad setting: the error is printed once, and no rank says it is
    saving a checkpoint."""
    ds = {"train_micro_batch_size_per_gpu": 1}
    if case == "deepspeed":
        ds["optimizer"] = {"type": "Lamb"}
    j = write_job(os.path.join(base, "mpi_%s.json" % case), "model" if case != "model" else "no-such-model",
                  "run_mpi_" + case, "train.jsonl", ds=ds, train_opts={"max_steps": 2})
    p = subprocess.run([MPIRUN, *MPI_ARGS, "-np", "2", QTUNE, "train", j], capture_output=True, text=True,
                       env=env(), timeout=120)
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if l.startswith("qtune: error:")]
    assert len(errors) == 1, p.stderr
    assert ("Lamb" if case == "deepspeed" else "no-such-model") in errors[0]
    assert "saving a checkpoint" not in p.stderr and "stop requested" not in p.stderr, p.stderr
