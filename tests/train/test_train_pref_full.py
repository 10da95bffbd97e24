"""DPO with full fine-tuning (docs/preference.md): the reference is the
starting weights, whose log-probs one pass computes before training
(precompute_ref_log_probs, TRL's name) and caches beside the token cache.
20 steps of `qtune train` against the PyTorch reference (tests/ref's model in
float64, TRL's sigmoid loss, torch.optim.AdamW, clip_grad_norm_): loss and
TRL's metrics every step and every final weight within 1e-4 (rewards and
margins also within 1e-5 of the sums they are made of), Qwen2. Then the
cache: a second run reads it, a changed model invalidates it, a resume uses
the starting weights' log-probs, not the checkpoint's."""
import json
import os

import numpy as np
import torch

from test_train_pref import (A, B, CLIP, LR, N_PAIRS, QWEN_TOKENIZER, STEPS, encode, make_model, objective_loss, pairs,  # noqa: F401
                             pytestmark, seq_logp, write_job, write_pairs)
from trainutil import run, st, step_lines

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)

OBJ = {"type": "dpo", "beta": 0.1}


def full_job(d, max_steps=STEPS, **extra):
    path = write_job(os.path.join(d, "job.json"), "pairs.jsonl", dict(OBJ, **extra), max_steps=max_steps)
    job = json.load(open(path))
    del job["lora"]
    job["deepspeed"]["optimizer"]["params"]["weight_decay"] = 0.0  # no decay groups to mirror
    job["data"]["cache_dir"] = "cache"
    json.dump(job, open(path, "w"))
    return path


def reference(model_dir, sides, steps=STEPS):
    pol = qwen1_ref.reference(model_dir, dtype=torch.float64)
    base = qwen1_ref.reference(model_dir, dtype=torch.float64)
    params = pol.trainables()
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with torch.no_grad():  # the starting weights' log-probs, once per side (precompute_ref_log_probs)
        ref = [tuple(seq_logp(base, ids, m)[0] for ids, m in side) for side in sides]
    out = []
    for s in range(steps):
        lp = {k: [] for k in ("pc", "pr", "nc", "nr", "rc", "rr")}
        for i in [(s * A * B + j) % N_PAIRS for j in range(A * B)]:
            (ci, cm), (ri, rm) = sides[i]
            for key, ids, m in (("c", ci, cm), ("r", ri, rm)):
                v, n = seq_logp(pol, ids, m)
                lp["p" + key].append(v)
                lp["n" + key].append(n)
                lp["r" + key].append(ref[i][key == "r"])
        loss, metrics = objective_loss(OBJ, *(torch.stack(lp[k]) for k in ("pc", "pr", "nc", "nr", "rc", "rr")))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        opt.step()
        metrics["loss"] = float(loss)
        out.append(metrics)
    return out, pol


def test_full_ft_dpo_20_steps_match_trl(tmp_path):
    d = str(tmp_path)
    model, _ = make_model(d, "qwen2")
    ps = pairs()
    write_pairs(os.path.join(d, "pairs.jsonl"), ps, "trl")
    p = run("train", full_job(d), timeout=1200)  # seconds on a quiet CPU; minutes on a shared one
    assert "reference: the starting weights, their log-probs computed once before training" in p.stderr, p.stderr
    assert "one pass with the starting weights" in p.stderr, p.stderr
    sides = [(encode(model, d, pr, c), encode(model, d, pr, j)) for pr, c, j in ps]
    want, pol = reference(model, sides)
    got = step_lines(os.path.join(d, "out"))
    assert len(got) == STEPS
    for s, (g, r) in enumerate(zip(got, want)):
        # rewards and margins are beta times differences of sums of tens of nats, summed in fp32: also
        # within 1e-5 of the sums they are made of, as tests/ref/test_ref_pref.py holds them
        made_of = OBJ["beta"] * max(abs(r["logps/chosen"]), abs(r["logps/rejected"]))
        for k, v in r.items():
            tol = 1e-4 * max(abs(v), 1e-2 if k != "loss" else abs(v))
            if k.startswith("rewards/") and k != "rewards/accuracies":
                tol = max(tol, 1e-5 * made_of)
            assert abs(g[k] - v) <= tol, "step %d %s: %.8g vs reference %.8g" % (s + 1, k, g[k], v)
    final = st.read(os.path.join(d, "out", "final", "model.safetensors"))
    worst = 0.0
    for k, v in pol.p.items():
        want_w = v.detach().numpy()
        worst = max(worst, float(np.abs(final[k] - want_w).max()))
        assert np.allclose(final[k], want_w, rtol=1e-4, atol=1e-4), k
    print("full-ft dpo: max |w - w_ref| = %.3g, accuracy %.2f -> %.2f" % (worst, want[0]["rewards/accuracies"],
                                                                         want[-1]["rewards/accuracies"]))


def test_reference_cache_and_resume(tmp_path):
    """The cache is read back by a second run (same numbers), rebuilt when the model changes, and a run
    resumed from a checkpoint uses the starting weights' log-probs (its steps equal an unbroken run's)
    even with the cache gone."""
    d = str(tmp_path)
    make_model(d, "qwen2")
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
        "--tokenizer", QWEN_TOKENIZER, "--force")
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
    make_model(d, "qwen2")
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
    model, _ = make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    run("train", full_job(d, max_steps=2))
    final = os.path.join(d, "out", "final")

    def ev(m, obj, *more):
        p = run("eval", "--model", m, "--tokenizer", model, "--data", os.path.join(d, "pairs.jsonl"), "--seq-len",
                40, "--batch", 2, "--objective", json.dumps(obj), *more)
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
