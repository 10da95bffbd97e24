"""Issue 22 (meet users where they are), at the CLI: a run says what it
resolved (each DeepSpeed "auto", then one line with precision, ZeRO, optimizer,
schedule, checkpointing, batch and device)."""
import json
import os

import pytest

from trainutil import init_model, run, write_job, write_tokens


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
