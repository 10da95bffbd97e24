"""qtune eval's command line and input checks: a line with text after its JSON value is refused with
the file and line; the default --seq-len is min(1024, max_position_embeddings); an unknown --format
is a usage error (exit 2); a NaN or infinite loss is an error, never printed as a result; a
perplexity past a double is null; the model's and adapter's JSON files are read as strictly as the
data (nothing after the object).
(Reference parity of the loss itself: tests/ref/test_ref_forward.py.)"""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from conftest import SRC, qtune

REF = os.path.join(SRC, "tests", "ref")
sys.path.insert(0, REF)
import st  # noqa: E402

_spec = importlib.util.spec_from_file_location("ref_helpers", os.path.join(REF, "conftest.py"))
ref_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_helpers)

SHAPE = "qwen2-gqa1-d64-tied-f32"


def make_model(d, max_pos=None):
    cfg = ref_helpers.make_model(str(d), SHAPE, seed=3)
    if max_pos is not None:
        cfg["max_position_embeddings"] = max_pos
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(d)


def write_lines(path, *lines):
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    return str(path)


def result(p):
    """The last stdout line, which must be eval's result object."""
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out) == {"loss", "ppl", "tokens"}
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "model")


@pytest.mark.parametrize("tail", [b" junk", b"x", b'{"input_ids": [4, 5]}', b" ,", b"]"])
def test_text_after_the_json_value_is_refused(model, tmp_path, tail):
    data = write_lines(tmp_path / "trail.jsonl", b'{"input_ids": [1, 2, 3]}', b'{"input_ids": [1, 2, 3]}' + tail)
    p = qtune("eval", "--model", model, "--data", data, check=1)
    err = p.stderr.strip().splitlines()[-1]
    assert "trail.jsonl:2:" in err and "text after the JSON object" in err, err
    assert "loss" not in p.stdout


def test_trailing_whitespace_and_crlf_are_still_accepted(model, tmp_path):
    data = write_lines(tmp_path / "ws.jsonl", b'{"input_ids": [1, 2, 3]}  \t', b'{"input_ids": [4, 5, 6]}\r')
    assert result(qtune("eval", "--model", model, "--data", data, check=0))["tokens"] == 4


def test_default_seq_len_is_max_position_embeddings_when_smaller(tmp_path):
    """A model with max_position_embeddings 16 evaluates without --seq-len: examples are cut at 16
    tokens, exactly as with --seq-len 16 (before: refused, the default 1024 being past the limit)."""
    small = make_model(tmp_path / "small", max_pos=16)
    ids = list(range(1, 41))
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"input_ids": ids}) + "\n" + json.dumps({"input_ids": ids[:5]}) + "\n")
    p = qtune("eval", "--model", small, "--data", data, check=0)
    got = result(p)
    assert got["tokens"] == 15 + 4, got  # 16 kept tokens carry 15 next-token labels; 5 carry 4
    assert "--seq-len 16" in p.stderr  # the warning counts the cut example at the default used
    assert got == result(qtune("eval", "--model", small, "--data", data, "--seq-len", 16, check=0))
    # an explicit --seq-len past the limit is still refused, naming it
    p = qtune("eval", "--model", small, "--data", data, "--seq-len", 17)
    assert p.returncode == 1 and "max_position_embeddings" in p.stderr


def test_default_seq_len_is_1024_on_a_larger_model(model, tmp_path):
    data = tmp_path / "longer.jsonl"
    data.write_text(json.dumps({"input_ids": [i % 300 for i in range(1100)]}) + "\n")
    got = result(qtune("eval", "--model", model, "--data", data, check=0))
    assert got["tokens"] == 1023, got


@pytest.mark.parametrize("fmt", ["bogus", "", "TEXT", "jsonl"])
def test_unknown_format_is_a_usage_error(model, tmp_path, fmt):
    data = write_lines(tmp_path / "ok.jsonl", b'{"input_ids": [1, 2, 3]}')
    p = qtune("eval", "--model", model, "--data", data, "--format", fmt, check=2)
    err = p.stderr.strip().splitlines()[-1]
    assert "--format" in err and "'%s'" % fmt in err and "auto, text, messages, sharegpt, alpaca, prompt_completion or tokens" in err, err
    assert p.stdout == ""
    # the known names still work
    for good in ("tokens", "input_ids", "auto"):
        qtune("eval", "--model", model, "--data", data, "--format", good, check=0)


@pytest.mark.parametrize("lines,extra", [([b'{"input_ids": [5]}'], []),
                                         ([b'{"input_ids": [1, 2, 3]}'], ["--seq-len", "1"])])
def test_no_labelled_token_says_what_to_give(model, tmp_path, lines, extra):
    """One-token examples (or --seq-len 1) have nothing to score: the error
    says why and what to give (it said only that no token carries a label)."""
    data = write_lines(tmp_path / "d.jsonl", *lines)
    p = qtune("eval", "--model", model, "--data", data, *extra, check=1)
    err = p.stderr.strip().splitlines()[-1]
    assert "no token carries a label" in err and "examples of 2 or more tokens" in err, err
    assert p.stdout == ""


@pytest.mark.parametrize("opt", ["--seq-len", "--batch"])
def test_a_too_large_count_is_named_with_its_range(model, tmp_path, opt):
    """A count past 2^20 is refused with the range (it said 'must be a
    positive integer' of a positive integer)."""
    data = write_lines(tmp_path / "d.jsonl", b'{"input_ids": [1, 2, 3]}')
    for bad in ("0", "99999999999", "x"):
        p = qtune("eval", "--model", model, "--data", data, opt, bad, check=2)
        assert "must be a whole number from 1 to 1048576, not '%s'" % bad in p.stderr, p.stderr


def test_an_unknown_option_is_named_as_one(model, tmp_path):
    """An unknown option is called unknown wherever it stands; at the end of the line it was reported as
    'needs a value', as if it were an option eval takes. A known option at the end still needs its value."""
    data = write_lines(tmp_path / "d.jsonl", b'{"input_ids": [1, 2, 3]}')
    for args in (["--bogus"], ["--bogus", "1"], ["--json"]):
        p = qtune("eval", "--model", model, "--data", data, *args, check=2)
        assert "unknown option '%s'" % args[0] in p.stderr, p.stderr
    p = qtune("eval", "--model", model, "--data", data, "--batch", check=2)
    assert "--batch needs a value" in p.stderr, p.stderr


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_loss_is_an_error(tmp_path, bad):
    """Weights holding NaN or inf make every log-probability non-finite: eval stops with one sentence
    naming the data file and line and the model, prints no result and leaves no --per-token file."""
    d = make_model(tmp_path / ("model_" + bad))
    path = os.path.join(d, "model.safetensors")
    w = {k: np.asarray(v, dtype=np.float32) for k, v in st.read(path).items()}
    w["model.norm.weight"][3] = float(bad)
    st.write(path, w, "F32")
    data = write_lines(tmp_path / "d.jsonl", b"", b'{"input_ids": [1, 2, 3, 4]}', b'{"input_ids": [5, 6]}')
    pt = tmp_path / "per_token.jsonl"
    for batch in ("1", "2"):
        p = qtune("eval", "--model", d, "--data", data, "--batch", batch, "--per-token", pt, check=1)
        err = p.stderr.strip().splitlines()
        assert len(err) == 1, p.stderr
        # an inf weight gives +inf and -inf logits: their log-sum-exp is inf - inf = NaN (before the
        # vectorised exp propagated NaN, it clamped that NaN and the loss read as infinite)
        assert "d.jsonl line 2" in err[0] and "the loss is NaN" in err[0], err
        assert d in err[0] and "not a finite number" in err[0], err
        assert "loss" not in p.stdout and not pt.exists()


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_nonfinite_logit_of_an_unseen_token_is_an_error(tmp_path, bad):
    """One lm_head row (the tied embedding of token 300, which the data never uses) holding NaN or
    inf makes that token's logit non-finite at every position while every other value stays finite.
    The vectorised exp used to clamp a NaN to exp(-87.3) ~ 0, so eval printed a finite, wrong loss
    with exit 0 (issue 24 item 9); now the log-sum-exp is NaN and eval stops as for NaN weights."""
    d = make_model(tmp_path / ("model_" + bad))
    path = os.path.join(d, "model.safetensors")
    w = {k: np.asarray(v, dtype=np.float32) for k, v in st.read(path).items()}
    w["model.embed_tokens.weight"][300, 5] = float(bad)
    st.write(path, w, "F32")
    data = write_lines(tmp_path / "d.jsonl", b'{"input_ids": [1, 2, 3, 4]}', b'{"input_ids": [5, 6]}')
    p = qtune("eval", "--model", d, "--data", data, check=1)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "d.jsonl line 1" in err[0] and "not a finite number" in err[0], p.stderr
    assert "loss" not in p.stdout, p.stdout


def test_perplexity_past_a_double_is_null(tmp_path):
    """A finite loss above ~709.78 nats (here: the final norm scaled by 3000) is a result, but its
    exp overflows: the result line stays JSON, with "ppl": null (printf wrote "inf")."""
    d = make_model(tmp_path / "loud")
    path = os.path.join(d, "model.safetensors")
    w = {k: np.asarray(v, dtype=np.float32) for k, v in st.read(path).items()}
    w["model.norm.weight"] *= 3000
    st.write(path, w, "F32")
    data = write_lines(tmp_path / "d.jsonl", b'{"input_ids": [1, 2, 3, 4]}')
    p = qtune("eval", "--model", d, "--data", data, check=0)
    last = p.stdout.strip().splitlines()[-1]
    got = json.loads(last, parse_constant=lambda c: pytest.fail("not JSON: %s in %s" % (c, last)))
    assert got["loss"] > 710 and np.isfinite(got["loss"]) and got["ppl"] is None and got["tokens"] == 3, got


def copy_model(model, dst):
    import shutil
    shutil.copytree(model, dst)
    return str(dst)


def append(path, tail):
    with open(path, "ab") as f:
        f.write(tail)


def shard(d):
    """The model folder as one shard listed by model.safetensors.index.json (no model.safetensors)."""
    names = list(st.read(os.path.join(d, "model.safetensors")))
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}, f)


@pytest.mark.parametrize("which", ["config.json", "adapter_config.json", "tokenizer.json",
                                   "model.safetensors.index.json"])
def test_text_after_the_json_object_of_a_model_file_is_refused(model, tmp_path, which):
    """The JSON files eval reads besides the data (the model's config.json, index and tokenizer.json,
    the adapter's adapter_config.json) are refused, naming the file, when text follows the object:
    Hugging Face's readers (json.load, serde_json) refuse them too. Whitespace after it is fine."""
    d = copy_model(model, tmp_path / "m")
    adapter = None
    if which == "tokenizer.json":
        import shutil
        shutil.copy(os.path.join(SRC, "fuzz", "corpus", "tokenizer", "tiny.json"), os.path.join(d, which))
    if which == "model.safetensors.index.json":
        shard(d)
    if which == "adapter_config.json":
        sys.path.insert(0, os.path.dirname(__file__))
        from test_generate import write_adapter
        adapter = str(tmp_path / "adapter")
        with open(os.path.join(d, "config.json")) as f:
            write_adapter(adapter, json.load(f))
    path = os.path.join(adapter or d, which)
    data = write_lines(tmp_path / "ok.jsonl", b'{"input_ids": [1, 2, 3]}')
    args = ["eval", "--model", d, "--data", data] + (["--adapter", adapter] if adapter else [])
    append(path, b"\n \t\n")
    want = result(qtune(*args, check=0))
    append(path, b'{"x": 1}\n')
    p = qtune(*args, check=1)
    err = p.stderr.strip().splitlines()[-1]
    assert which in err and "loss" not in p.stdout, err
    assert want["tokens"] == 2
