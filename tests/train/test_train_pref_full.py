"""DPO with full fine-tuning (docs/preference.md): the reference is the
starting weights, whose log-probs one pass computes before training
(precompute_ref_log_probs, TRL's name) and caches beside the token cache.
20 steps of `qtune train` against the PyTorch reference (tests/ref's model in
float64, TRL's formulas, torch.optim.AdamW, clip_grad_norm_) for DPO
(sigmoid), IPO, ORPO and SimPO on Qwen2 and Qwen3 (test_train_pref.py's
harness): loss and TRL's metrics every step and every final weight within
1e-4 (rewards and margins also within 1e-5 of the sums they are made of).
Then the cache: a second run reads it, a changed model invalidates it, a
resume uses the starting weights' log-probs, not the checkpoint's. The model
is test_train_pref.py's with its tiny tokenizer (seconds a case)."""
import json
import os

import numpy as np
import pytest

from test_train_pref import (OBJECTIVES, STEPS, T_TINY, TINY_TOKENIZER, check_20_steps, make_model, pairs, write_job,
                             write_pairs)
from trainutil import run, step_lines

OBJ = {"type": "dpo", "beta": 0.1}


def full_job(d, max_steps=STEPS, **extra):
    path = write_job(os.path.join(d, "job.json"), "pairs.jsonl", dict(OBJ, **extra), max_steps=max_steps,
                     seq_len=T_TINY)
    job = json.load(open(path))
    del job["lora"]
    job["deepspeed"]["optimizer"]["params"]["weight_decay"] = 0.0  # no decay groups to mirror
    job["data"]["cache_dir"] = "cache"
    json.dump(job, open(path, "w"))
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_full_ft_20_steps_match_trl(tmp_path, arch, name):
    """dpo and ipo through precompute_ref_log_probs (on by default for full fine-tuning); orpo and simpo need
    no reference."""
    check_20_steps(tmp_path, arch, OBJECTIVES[name], "%s-full-%s" % (arch, name), full=True)


def test_reference_cache_and_resume(tmp_path):
    """The cache is read back by a second run (same numbers), rebuilt when the model changes, and a run
    resumed from a checkpoint uses the starting weights' log-probs (its steps equal an unbroken run's)
    even with the cache gone."""
    d = str(tmp_path)
    make_model(d, "qwen2", TINY_TOKENIZER)
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    job = full_job(d, max_steps=4)
    p1 = run("train", job, "--set", "output_dir=one")
    caches = [f for f in os.listdir(os.path.join(d, "cache")) if f.endswith(".qref")]
    assert len(caches) == 1, os.listdir(os.path.join(d, "cache"))
    p2 = run("train", job, "--set", "output_dir=two", "--set", "train.max_steps=2")
    assert "one pass with the starting weights" in p1.stderr and "read from" in p2.stderr, p2.stderr
    os.remove(os.path.join(d, "cache", caches[0]))
    p3 = run("train", job, "--set", "output_dir=two")  # resumes at step 2; the reference from the model folder
    assert "resuming from" in p3.stderr and "one pass with the starting weights" in p3.stderr, p3.stderr
    a, b = step_lines(os.path.join(d, "one")), step_lines(os.path.join(d, "two"))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["rewards/margins"] for m in a] == [m["rewards/margins"] for m in b]
    # another model (a new init): the key differs, so the pass runs again
    run("init", "--out", os.path.join(d, "model"), "--config", os.path.join(d, "config.json"), "--seed", 2,
        "--tokenizer", TINY_TOKENIZER, "--force")
    p4 = run("train", job, "--set", "output_dir=three", "--set", "train.max_steps=1")
    assert "one pass with the starting weights" in p4.stderr, p4.stderr
    assert abs(step_lines(os.path.join(d, "three"))[0]["rewards/margins"]) < 1e-5  # policy = reference at step 1
    # the refusal that remains: no frozen copy
    p = run("train", job, "--set", "output_dir=four", "--set", "objective.precompute_ref_log_probs=false",
            check=False)
    assert p.returncode != 0 and "keeps no frozen copy" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "four"))


def test_plan_counts_the_reference_pass(tmp_path):
    d = str(tmp_path)
    make_model(d, "qwen2", TINY_TOKENIZER)
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    job = full_job(d, max_steps=1)
    out = run("plan", job).stdout
    assert "reference: one forward pass over every training and eval pair before step 1" in out, out
    out = run("plan", job, "--set", 'lora={"r": 4}').stdout
    assert "reference: a forward of the same rows with the adapter off" in out, out


def test_eval_with_ref_model(tmp_path):
    """qtune eval --objective dpo --ref-model: a full fine-tuning's final/ against the model it started from.
    Its rewards are beta times the difference of the two models' reference-free log-probs, and the
    starting model against itself scores log 2 with every reward 0."""
    d = str(tmp_path)
    model, _ = make_model(d, "qwen2", TINY_TOKENIZER)
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    run("train", full_job(d, max_steps=2))
    final = os.path.join(d, "out", "final")

    def ev(m, obj, *more):
        p = run("eval", "--model", m, "--tokenizer", model, "--data", os.path.join(d, "pairs.jsonl"), "--seq-len",
                T_TINY, "--batch", 2, "--objective", json.dumps(obj), *more)
        return json.loads(p.stdout.strip().splitlines()[-1])
    free = dict(OBJ, reference_free=True)
    pol, ref = ev(final, free), ev(model, free)
    got = ev(final, OBJ, "--ref-model", model)
    for side in ("chosen", "rejected"):
        assert abs(got["eval_logps/" + side] - pol["eval_logps/" + side]) <= 1e-6 * abs(pol["eval_logps/" + side])
        want = OBJ["beta"] * (pol["eval_logps/" + side] - ref["eval_logps/" + side])
        assert abs(got["eval_rewards/" + side] - want) <= 1e-5 * OBJ["beta"] * abs(ref["eval_logps/" + side])
    same = ev(model, OBJ, "--ref-model", model)
    assert same["eval_rewards/margins"] == 0 and same["eval_rewards/accuracies"] == 0
    assert abs(same["eval_loss"] - np.log(2)) < 1e-9
