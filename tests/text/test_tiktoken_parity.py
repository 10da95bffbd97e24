"""The original Qwen's tokenizer (qwen.tiktoken: base64 token and rank per
line, tiktoken's rank-based merges, Qwen's split pattern and special tokens)
against an independent tiktoken: js-tiktoken from the npm registry, on the
same > 2 MB corpus as the tokenizer.json parity test. Id for id.

The qwen.tiktoken is derived from the Qwen3 tokenizer.json the tests already
fetch. Its ranks equal the original file's: Qwen2/Qwen3's tokenizer.json is
the original Qwen vocabulary converted to Hugging Face's format -- model.vocab
maps each of the 151,643 byte sequences of qwen.tiktoken, written in GPT-2's
byte alphabet, to its tiktoken rank as the id (ids 0..151642, dense), and the
special tokens start at 151643 with <|endoftext|>, <|im_start|>, <|im_end|> in
both. So decoding each vocab string back to bytes and writing "base64 id"
reproduces the original lines (the test checks the ids are dense and that the
256 single bytes are there, as the original's first 256 ranks are)."""
import base64
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from byte_level import bytes_to_unicode  # noqa: E402
from conftest import NODE_DIR, run_qtune  # noqa: E402
from test_tokenizer_parity import corpus, first_mismatch  # noqa: E402,F401  (the same corpus fixture)


def byte_decoder():
    """GPT-2's bytes_to_unicode, inverted."""
    return {c: b for b, c in bytes_to_unicode().items()}


@pytest.fixture(scope="module")
def qwen_tiktoken(qwen_json, tmp_path_factory):
    tok = json.load(open(qwen_json, encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    specials = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert specials["<|endoftext|>"] == 151643 and specials["<|im_start|>"] == 151644
    dec = byte_decoder()
    ranks = sorted((i, bytes(dec[c] for c in s)) for s, i in vocab.items() if i < 151643)
    assert [i for i, _ in ranks] == list(range(151643))  # dense, as tiktoken ranks are
    assert {b for _, b in ranks if len(b) == 1} == {bytes([x]) for x in range(256)}
    path = str(tmp_path_factory.mktemp("qwen1") / "qwen.tiktoken")
    with open(path, "w") as f:
        for i, b in ranks:
            f.write("%s %d\n" % (base64.b64encode(b).decode(), i))
    return path


def run_js(args, timeout=1200):
    r = subprocess.run(["node", os.path.join(NODE_DIR, "tiktoken.js")] + args, capture_output=True, text=True,
                       timeout=timeout, cwd=NODE_DIR)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_ids_match_js_tiktoken(qtune, qwen_tiktoken, corpus):  # noqa: F811
    path, _ = corpus
    ref = run_js([qwen_tiktoken, path])["ids"]
    got = run_qtune(qtune, ["--tokenizer", qwen_tiktoken, "--file", path, "--json"])["ids"]
    i = first_mismatch(ref, got)
    if i >= 0:
        lo = max(0, i - 8)
        ctx = run_qtune(qtune, ["--tokenizer", qwen_tiktoken, "--decode", ",".join(map(str, ref[lo:i + 8])), "--json"])
        pytest.fail(f"first mismatch at id {i} of {len(ref)}: js-tiktoken {ref[lo:i + 8]} qtune {got[lo:i + 8]}; "
                    f"text there: {ctx['text']!r}")
    assert len(ref) == len(got) > 400000


SHORT = [
    "Hello, my dog is cute",
    "你好，世界！",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|extra_0|><|extra_204|> <|endoftext|>",
    "I'M DON'T we'LL they'Ve",
    "tabs\tand\r\nwindows\r\n\n\n   lines  ",
    "e\u0301 n\u0303 \u1100\u1161 12345 3.14",
    "",
]


def test_short_strings_and_specials(qtune, qwen_tiktoken, tmp_path):
    p = tmp_path / "many.json"
    p.write_text(json.dumps(SHORT))
    ref = run_js([qwen_tiktoken, "--many", str(p)])
    for text, want in zip(SHORT, ref):
        got = run_qtune(qtune, ["--tokenizer", qwen_tiktoken, "--text", text, "--json"])["ids"]
        assert got == want, text
    got = run_qtune(qtune, ["--tokenizer", qwen_tiktoken, "--text", SHORT[3], "--json"])["ids"]
    assert got[:2] == [151643 + 3, 151643 + 3 + 204] and got[-1] == 151643  # the specials after the ranks
    # a folder holding qwen.tiktoken and no tokenizer.json loads it
    folder = os.path.dirname(qwen_tiktoken)
    assert run_qtune(qtune, ["--tokenizer", folder, "--text", SHORT[0], "--json"])["ids"] == ref[0]


@pytest.mark.parametrize("content,msg", [
    (b"IQ== 0\nIg== 0\n", "rank 0 appears twice"),
    (b"IQ== 0\n!!!! 1\n", ":2: expected"),
    (b"IQ== x\n", "expected"),
])
def test_damaged_files_refused_by_line(qtune, tmp_path, content, msg):
    p = tmp_path / "qwen.tiktoken"
    # 256 byte tokens so the length check passes, then the damage
    lines = b"".join(b"%s %d\n" % (base64.b64encode(bytes([i])), i + 2) for i in range(256))
    p.write_bytes(content + lines)
    r = subprocess.run([qtune, "tokenize", "--tokenizer", str(p), "--text", "x"], capture_output=True, text=True)
    assert r.returncode == 1 and msg in r.stderr and "qwen.tiktoken" in r.stderr, r.stderr


def test_chatml_as_qwen_chat(qtune, qwen_tiktoken, tmp_path):
    """The original Qwen-Chat's ChatML (qwen_generation_utils.make_context): the Qwen2.5 layout with
    its own default system prompt; ids those of js-tiktoken on the rendered text; the assistant's
    content and its <|im_end|> labelled."""
    job = {"messages": [{"role": "user", "content": "你好, what is 2+2?"}, {"role": "assistant", "content": "4."}],
           "add_generation_prompt": False}
    p = tmp_path / "chat.json"
    p.write_text(json.dumps(job))
    out = run_qtune(qtune, ["--tokenizer", qwen_tiktoken, "--chat", str(p), "--json"])
    want = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n你好, what is 2+2?"
            "<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n")
    assert out["text"] == want
    many = tmp_path / "many.json"
    many.write_text(json.dumps([want, "4.<|im_end|>"]))
    ref, tail = run_js([qwen_tiktoken, "--many", str(many)])
    assert out["ids"] == ref
    labelled = [i for i, l in zip(out["ids"], out["labels"]) if l != -100]
    assert labelled == tail and labelled[-1] == 151645  # "4." and <|im_end|>
