"""Held-out preference evaluation (docs/preference.md): `qtune eval --objective`
and data.eval in a preference job report TRL's eval_ metrics (eval_loss,
eval_rewards/chosen, .../rejected, .../accuracies, .../margins, eval_logps/...),
held against the PyTorch reference (tests/ref's model in float64, TRL's
formulas) within 1e-5. CI-sized: the tiny model of test_train_pref.py, one
or two training steps."""
import json
import os

import torch

from test_train_pref import (B, R, T, adapter, encode, make_model, objective_loss, pairs, seq_logp, write_job,
                             write_pairs)
from test_train_pref import needs_qwen_tokenizer as pytestmark  # noqa: F401
from trainutil import run, step_lines

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)

EVAL_PAIRS = 6


def held_out():
    return pairs(seed=11)[:EVAL_PAIRS]


def reference_metrics(model_dir, w, sides, obj, base_dir=None):
    """TRL's eval metrics over all pairs in one batch: the policy (w: a LoRA adapter, or None for the model's
    own weights) against the reference (the base with the adapter off, or base_dir's weights)."""
    pol = qwen1_ref.reference(model_dir, dtype=torch.float64,
                              lora={"r": R, "alpha": 8, "weights": w} if w is not None else None)
    base = qwen1_ref.reference(base_dir or model_dir, dtype=torch.float64)
    lp = {k: [] for k in ("pc", "pr", "nc", "nr", "rc", "rr")}
    with torch.no_grad():
        for (ci, cm), (ri, rm) in sides:
            for key, ids, m in (("c", ci, cm), ("r", ri, rm)):
                v, n = seq_logp(pol, ids, m)
                lp["p" + key].append(v)
                lp["n" + key].append(n)
                lp["r" + key].append(seq_logp(base, ids, m)[0])
        loss, metrics = objective_loss(obj, *(torch.stack(lp[k]) for k in ("pc", "pr", "nc", "nr", "rc", "rr")))
    metrics["loss"] = float(loss)
    return {"eval_" + k: v for k, v in metrics.items()}


def close(got, want, what, tol=1e-5, beta=0.1):
    """Within tol relative; rewards and margins (beta times a difference of sums of tens of nats) within tol
    of the sums they are made of, as tests/ref/test_ref_pref.py holds them."""
    made_of = beta * max(abs(want["eval_logps/chosen"]), abs(want["eval_logps/rejected"]))
    for k, v in want.items():
        scale = max(abs(v), made_of if "rewards/" in k and "accuracies" not in k else 1e-2)
        assert abs(got[k] - v) <= tol * scale, "%s %s: %.9g vs reference %.9g" % (what, k, got[k], v)


def eval_cli(d, *args):
    p = run("eval", "--model", os.path.join(d, "model"), "--data", os.path.join(d, "held.jsonl"), "--seq-len", T,
            "--batch", 2, *args)
    return json.loads(p.stdout.strip().splitlines()[-1])


def prepare(d):
    model, cfg = make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    write_pairs(os.path.join(d, "held.jsonl"), held_out(), "trl")
    w = adapter(d, cfg)
    sides = [(encode(model, d, p, c), encode(model, d, p, j)) for p, c, j in held_out()]
    return model, w, sides


def test_eval_cli_matches_trl(tmp_path):
    """qtune eval --objective on held-out pairs, dpo (the reference: the adapter off) and orpo, against TRL's
    formulas on the reference model."""
    d = str(tmp_path)
    model, w, sides = prepare(d)
    for obj in ({"type": "dpo", "beta": 0.1}, {"type": "orpo", "beta": 0.2}):
        got = eval_cli(d, "--adapter", os.path.join(d, "adapter0"), "--objective", json.dumps(obj))
        assert got["pairs"] == EVAL_PAIRS
        close(got, reference_metrics(model, w, sides, obj), obj["type"], beta=obj["beta"])
    # a name alone is the type with TRL's defaults
    assert eval_cli(d, "--adapter", os.path.join(d, "adapter0"), "--objective", "dpo")["eval_loss"] == \
        eval_cli(d, "--adapter", os.path.join(d, "adapter0"), "--objective", '{"type": "dpo"}')["eval_loss"]
    # dpo without an adapter has no reference: refused with what to give
    p = run("eval", "--model", model, "--data", os.path.join(d, "held.jsonl"), "--objective", "dpo", check=False)
    assert p.returncode != 0 and "--ref-model" in p.stderr and "reference_free" in p.stderr, p.stderr
    p = run("eval", "--model", model, "--data", os.path.join(d, "held.jsonl"), "--objective", "dpp", check=False)
    assert p.returncode != 0 and "objective.type must be" in p.stderr, p.stderr


def test_in_training_eval_reports_trl_names(tmp_path):
    """data.eval with objective dpo: the eval before step 1 equals the reference at the init_from adapter,
    and the one after the last step equals `qtune eval` of final/ (the same pairs, the same reference)."""
    d = str(tmp_path)
    model, w, sides = prepare(d)
    obj = {"type": "dpo", "beta": 0.1}
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", obj, max_steps=2)
    p = run("train", job, "--set", "data.eval=held.jsonl", "--set", "train.eval_steps=1")
    assert "eval_rewards/accuracies" in p.stderr, p.stderr
    lines = [json.loads(l) for l in open(os.path.join(d, "out", "metrics.jsonl")) if '"eval_loss"' in l]
    assert [l["step"] for l in lines] == [0, 1, 2], lines
    for l in lines:
        assert l["eval_pairs"] == EVAL_PAIRS
        for k in ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_rewards/margins",
                  "eval_logps/chosen", "eval_logps/rejected"):
            assert k in l, (k, l)
    close(lines[0], reference_metrics(model, w, sides, obj), "step 0")
    final = eval_cli(d, "--adapter", os.path.join(d, "out", "final"), "--objective", json.dumps(obj))
    close(lines[-1], {k: v for k, v in final.items() if k.startswith("eval_")}, "step 2 vs qtune eval")
    assert len(step_lines(os.path.join(d, "out"))) == 2
