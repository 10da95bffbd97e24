"""qtune generate --prompts FILE --batch N: N sequences decode together (one weight read per step serves
them all, qt_model_decode_rows), and every prompt's reply equals its own separate run's: greedy ids for
prompts of different lengths, sequences leaving the batch at different steps (--ctx stops the long
prompts first, and free slots take the next prompts), f32, bf16 and f16 weights, an MLP width that is
not a multiple of 8 (the SwiGLU lanes straddle the rows), with and without a LoRA adapter; seeded
sampling too (each prompt is seeded with --seed). Bad files and options are refused."""
import json
import os

import pytest

from conftest import SRC, qtune
import importlib.util

_spec = importlib.util.spec_from_file_location("ref_helpers", os.path.join(SRC, "tests", "ref", "conftest.py"))
ref_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_helpers)
from test_generate import write_adapter  # noqa: E402

# (arch, H, KV, D, C, I, L, V, tied, dtype); I = 100 is not a multiple of the 8 SwiGLU lanes
SHAPES = {
    "f32-tied": ("qwen2", 2, 1, 32, 64, 100, 2, 300, True, "F32"),
    "bf16-untied": ("qwen2", 4, 2, 32, 128, 100, 2, 280, False, "BF16"),
    "f16-untied": ("qwen2", 4, 2, 32, 128, 168, 2, 280, False, "F16"),
}
PROMPTS = [[5, 17, 42], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250, 7], [33, 44, 55, 66, 77], [100, 101, 102, 103]]
CTX = 16  # the 9-token prompt stops at the context after 7 tokens, the others at --max-new
MAX_NEW = 10


def write_prompts(path, prompts=PROMPTS):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
        f.write("\n")  # blank lines are skipped


def alone(model, prompt, *extra):
    p = qtune("generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)), "--max-new", MAX_NEW,
              "--ctx", CTX, "--json", *extra, check=0)
    return json.loads(p.stdout.strip().splitlines()[-1])


def together(model, prompts_file, batch, *extra):
    p = qtune("generate", "--model", model, "--prompts", prompts_file, "--batch", batch, "--max-new", MAX_NEW,
              "--ctx", CTX, "--json", *extra, check=0)
    out = [json.loads(line) for line in p.stdout.strip().splitlines()]
    assert [o["index"] for o in out] == list(range(len(out)))
    assert "batch %d" % min(batch, len(out)) in p.stderr and "decode" in p.stderr
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("lora", [False, True])
def test_batch_equals_separate_runs(tmp_path, shape, lora):
    d, f = str(tmp_path / "m"), str(tmp_path / "p.jsonl")
    cfg = ref_helpers.make_model(d, SHAPES[shape], seed=3)
    extra = ["--temperature", "0"]
    if lora:
        a = str(tmp_path / "adapter")
        write_adapter(a, cfg, targets=("q_proj", "v_proj"))
        extra += ["--adapter", a]
    write_prompts(f)
    want = [alone(d, p, *extra) for p in PROMPTS]
    assert len({tuple(w["ids"]) for w in want}) > 1, "the replies should differ (test would not tell)"
    assert {w["stop"] for w in want} == {"max_new", "context"}
    for batch in (1, 4, 8):
        got = together(d, f, batch, *extra)
        for g, w in zip(got, want):
            assert (g["prompt_ids"], g["ids"], g["stop"]) == (w["prompt_ids"], w["ids"], w["stop"]), (batch, g, w)


def test_adapter_changes_the_batch(tmp_path):
    d, f, a = str(tmp_path / "m"), str(tmp_path / "p.jsonl"), str(tmp_path / "adapter")
    cfg = ref_helpers.make_model(d, SHAPES["f32-tied"], seed=3)
    write_adapter(a, cfg)
    write_prompts(f)
    base = together(d, f, 4, "--temperature", "0")
    tuned = together(d, f, 4, "--temperature", "0", "--adapter", a)
    assert [b["ids"] for b in base] != [t["ids"] for t in tuned]


def test_seeded_sampling_equals_separate_runs(tmp_path):
    d, f = str(tmp_path / "m"), str(tmp_path / "p.jsonl")
    ref_helpers.make_model(d, SHAPES["bf16-untied"], seed=5)
    write_prompts(f)
    extra = ["--temperature", "1.3", "--top-p", "0.9", "--seed", "11"]
    want = [alone(d, p, *extra)["ids"] for p in PROMPTS]
    assert [g["ids"] for g in together(d, f, 3, *extra)] == want


def test_plain_output_in_file_order(tmp_path):
    d, f = str(tmp_path / "m"), str(tmp_path / "p.jsonl")
    ref_helpers.make_model(d, SHAPES["f32-tied"], seed=3)
    write_prompts(f)
    p = qtune("generate", "--model", d, "--prompts", f, "--batch", 4, "--max-new", MAX_NEW, "--ctx", CTX,
              "--temperature", "0", check=0)
    lines = p.stdout.strip("\n").split("\n")
    assert [list(map(int, line.split())) for line in lines] == [alone(d, q, "--temperature", "0")["ids"]
                                                                for q in PROMPTS]


def test_bad_prompts_and_options(tmp_path):
    d, f = str(tmp_path / "m"), str(tmp_path / "p.jsonl")
    ref_helpers.make_model(d, SHAPES["f32-tied"], seed=3)
    write_prompts(f)
    p = qtune("generate", "--model", d, "--prompt-ids", "1,2", "--batch", 2)
    assert p.returncode == 2 and "--prompts" in p.stderr
    for bad in ("0", "257", "x"):
        p = qtune("generate", "--model", d, "--prompts", f, "--batch", bad)
        assert p.returncode == 2 and "--batch" in p.stderr
    p = qtune("generate", "--model", d, "--prompts", f, "--prompt-ids", "1")
    assert p.returncode == 2 and "exactly one" in p.stderr
    cases = {
        '{"prompt_ids": [1, 2]}\nnot json\n': "line 2",
        '{"prompt_ids": [1, 300]}\n': "prompt_ids[1]",
        '{"prompt_ids": [1], "prompt": "x"}\n': "one of the three",
        '{"prompt": "hello"}\n': "tokenizer",
        '\n\n': "no prompts",
        '{"prompt_ids": []}\n': "empty",
        '{"prompt_ids": %s}\n' % list(range(16)): "no room",
        # what cJSON left after the object, a NUL byte or a \u0000 escape was dropped unseen
        '{"prompt_ids": [1]}\n{"prompt_ids": [1, 2]} {"prompt_ids": [3]}\n': "line 2: text after the JSON object",
        '{"prompt_ids": [1]}\n\x00{"prompt_ids": [3]}\n': "line 2 holds a NUL byte",
        '{"prompt": "a\\u0000b"}\n': "NUL character",
    }
    for text, what in cases.items():
        with open(f, "w") as fh:
            fh.write(text)
        p = qtune("generate", "--model", d, "--prompts", f, "--batch", 2, "--ctx", CTX)
        assert p.returncode == 1 and what in p.stderr and f in p.stderr, (text, p.stderr)
        assert p.stdout == ""
    with open(f, "w") as fh:  # keys other than the prompt's were ignored in silence
        fh.write('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3], "max_new": 5, "prompt_ids": [4]}\n')
    p = qtune("generate", "--model", d, "--prompts", f, "--max-new", 2, "--json", check=0)
    warn = [line for line in p.stderr.splitlines() if "warning" in line]
    assert len(warn) == 1 and 'line 2: the key "max_new" is ignored' in warn[0], p.stderr
    assert [json.loads(line)["prompt_ids"] for line in p.stdout.splitlines()] == [[1, 2], [3]]
    p = qtune("generate", "--model", d, "--prompts", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 1 and "missing.jsonl" in p.stderr
