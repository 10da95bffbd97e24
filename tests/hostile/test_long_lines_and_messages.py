"""Long data lines and the wording of errors (issue 24 items 15 and 16;
docs/robustness.md, docs/data.md):

- a long line of input_ids costs a few times its size, not 20-40x (cJSON
  spent about 80 bytes per id), and reads the same tokens as before;
- the over-long line error names a setting that exists (data.max_line_bytes);
- range errors state the rule that was broken (the upper bound too);
- a 5,000-character path is elided in the message;
- "content": null is reported as null, not as a missing key;
- a --set without key=value is a command-line error (exit 2)."""
import glob
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from hostile_util import expect_error, ok, run, write, write_job, write_tokens

SRC_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("longlines")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    ok(["init", "--out", d / "chatmodel", "--preset", "tiny", "--seed", "1", "--tokenizer",
        os.path.join(SRC_ROOT, "fuzz", "corpus", "tokenizer", "tiny.json")])
    write_tokens(d / "tokens.jsonl", n=16)
    return d


GEN_LONG = """
import random, sys
r = random.Random(1)
with open(sys.argv[1], "w") as f:
    f.write('{"input_ids": [1')
    for _ in range(80):
        f.write("".join(", %d" % r.randint(1, 511) for _ in range(100_000)))
    f.write(']}\\n')
"""


def ids_line(n, seed, labels=False, extra=None, first_as=None):
    r = random.Random(seed)
    ids = [r.randint(1, 511) for _ in range(n)]
    obj = {}
    if extra:
        obj.update(extra)
    parts = [str(i) for i in ids]
    if first_as is not None:
        parts[0] = first_as
    text = '{"input_ids": [' + ", ".join(parts) + "]"
    if labels:
        labs = [-100 if k % 7 == 0 else i for k, i in enumerate(ids)]
        text += ', "labels": ' + json.dumps(labs)
    for k, v in obj.items():
        text += ", %s: %s" % (json.dumps(k), json.dumps(v))
    return text + "}\n", ids


def test_a_long_token_line_costs_a_few_times_its_size(base, tmp_path):
    """A 40 MB line of input_ids (8 million ids), four build threads: peak RSS
    under 4x the line plus 64 MB for the process (it was about 20x on one
    thread, plus a 64 MB copy of the line per extra thread)."""
    # written by another process: a child's peak RSS counts its parent's
    # pages at fork, so this process must not grow by the line's 100s of MB
    subprocess.run([sys.executable, "-c", GEN_LONG, str(tmp_path / "long.jsonl")], check=True)
    size = os.path.getsize(tmp_path / "long.jsonl")
    assert size > 36 << 20
    j = write_job(tmp_path / "job.json", str(base / "model"), "out", "long.jsonl", T=64,
                  data_opts={"num_workers": 4, "cache_dir": str(tmp_path / "cache")})
    r = run(["train", j], timeout=300)
    assert r.returncode == 0, r
    assert r.maxrss < 4 * size + (64 << 20), "peak RSS %.0f MB for a %.0f MB line" % (r.maxrss / 2**20, size / 2**20)


# a long text or messages line: English-like prose with Chinese, escaped
# newlines, quotes and backslashes, \u escapes (one a surrogate pair), raw
# accented letters; KIND text|messages, MB its size
GEN_PROSE = r"""
import json, random, sys
kind, mb, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
r = random.Random(11)
words = ("the of and to in is was for on that with as by at from model training data token loss gradient "
         "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \U0001F600 back\\slash \"quoted\" tab \u00e9t\u00e9").split()
zh = "\u4e2d\u6587\u6587\u672c\u7684\u8bad\u7ec3\u6570\u636e\u6a21\u578b"
def prose(n):
    parts, size = [], 0
    while size < n:
        if r.random() < 0.1:
            s = "".join(r.choice(zh) for _ in range(r.randint(5, 30))) + "\u3002"
        else:
            s = " ".join(r.choice(words) for _ in range(r.randint(5, 20))) + r.choice([".", ",", "!", " (1234).", ":\t"])
        if r.random() < 0.05:
            s += "\n\n"
        parts.append(s)
        size += len(s.encode()) + 1
    # raw UTF-8, with some characters spelt as \u escapes (one a surrogate pair)
    t = json.dumps(" ".join(parts), ensure_ascii=False)
    return t.replace("\u00e9t\u00e9", "\\u00e9t\\u00e9").replace("\U0001F600", "\\ud83d\\ude00")
n = int(mb * (1 << 20))
if kind == "text":
    body = '{"text": %s}' % prose(n)
else:
    body = ('{"messages": [{"role": "user", "content": %s}, {"role": "assistant", "content": %s}, '
            '{"role": "user", "content": %s}, {"role": "assistant", "content": %s}]}'
            % (prose(2000), prose(n // 2), prose(n // 4), prose(n // 4)))
json.loads(body)
with open(out, "w") as f:
    f.write(body + "\n")
"""


def cache_tokens(cache_dir):
    """Tokens in the one token cache of cache_dir (header, then 8 bytes an
    example plus one, then 5 bytes a token)."""
    (cache,) = glob.glob(str(cache_dir / "*.qtc"))
    return (os.path.getsize(cache) - 128 - 16) // 5


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_a_long_text_or_chat_line_costs_the_line_and_its_tokens(base, tmp_path, kind):
    """A 45 MB text or messages line: peak RSS over that of a one-line file of
    the same format at most the line plus the 5 bytes a token of the token
    buffer (ids and mask), plus a quarter of the line. With this test's
    tokenizer (264 ids, 1.2 bytes a token) that is about 5.3x the line; main
    (94f5fab) spent one line more on text (cJSON's copy of the string: 257
    MB, bound 239 MB) and 26x the line on messages (16-byte spans, a second
    id array and int32 labels per token, the rendered conversation: 1,178
    MB)."""
    subprocess.run([sys.executable, "-c", GEN_PROSE, kind, "40", str(tmp_path / "long.jsonl")], check=True)
    size = os.path.getsize(tmp_path / "long.jsonl")
    small = {"text": {"text": "a short line"},
             "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}}
    write(tmp_path / "small.jsonl", json.dumps(small[kind]) + "\n")
    peaks, tokens = {}, {}
    for name in ("small", "long"):
        j = write_job(tmp_path / ("job_%s.json" % name), str(base / "chatmodel"), "out_" + name, name + ".jsonl", T=64,
                      train_opts={"max_steps": 1},
                      data_opts={"mask_prompt": False, "cache_dir": str(tmp_path / ("cache_" + name))})
        r = run(["train", j], timeout=300)
        assert r.returncode == 0, r
        peaks[name], tokens[name] = r.maxrss, cache_tokens(tmp_path / ("cache_" + name))
    assert tokens["long"] > size // 2, tokens
    cost = peaks["long"] - peaks["small"]
    # tolerance: a quarter of the line. A messages line now renders through the model folder's Jinja
    # template (issue 41, 2026-12-06), which holds one more copy of the line while it tokenizes: 273 MB
    # (6.1x) measured against 5.3x for the ChatML path before it; the bound allows that line, and no more
    bound = (2.25 if kind == "messages" else 1.25) * size + 5 * tokens["long"]
    assert cost < bound, "a %.0f MB %s line (%d tokens) cost %.0f MB (%.1fx), over %.0f MB" % (
        size / 2**20, kind, tokens["long"], cost / 2**20, cost / size, bound / 2**20)


def cache_body(path):
    """The ids, mask and example table of a token cache (past its header)."""
    data = open(path, "rb").read()
    return data[128:]


def test_long_lines_read_the_same_tokens_as_before(base, tmp_path):
    """A long line takes the bounded path, unless one id is spelled 5e0 (5:
    only cJSON reads that): both files give a token cache with the same ids,
    label mask and example table, with labels (-100 every 7th) and another key
    beside them; and the same error, word for word, for an id out of range and
    for labels of the wrong length."""
    bodies = []
    for name, first in (("fast", "5"), ("slow", "5e0")):
        d = tmp_path / name
        os.makedirs(d)
        line, _ = ids_line(30_000, seed=2, labels=True, extra={"meta": {"source": [1, "x"]}}, first_as=first)
        assert len(line) > 64 << 10
        write(d / "data.jsonl", '{"input_ids": [1, 2, 3]}\n' + line + '{"input_ids": [4, 5]}\n')
        j = write_job(d / "job.json", str(base / "model"), "out", "data.jsonl", T=16,
                      train_opts={"max_steps": 1}, data_opts={"cache_dir": str(d / "cache")})
        ok(["train", j])
        (cache,) = glob.glob(str(d / "cache" / "*.qtc"))
        bodies.append(cache_body(cache))
    assert bodies[0] == bodies[1]
    for bad, want in ((dict(first_as=None), "input_ids[20000] = 600 is out of range"),
                      (dict(first_as=None, labels=True), "\"labels\" has 29999 entries but \"input_ids\" has 30000")):
        msgs = []
        for first in ("5", "5e0"):
            line, ids = ids_line(30_000, seed=3, labels=bad.get("labels", False), first_as=first)
            obj_text = line
            if "labels" in want:
                obj_text = obj_text.replace('"labels": [', '"labels": [', 1)
                k = obj_text.rindex("]")
                obj_text = obj_text[:obj_text.rindex(",", 0, k)] + obj_text[k:]
            else:
                parts = obj_text.split(", ")
                parts[20000] = "600"
                obj_text = ", ".join(parts)
            p = tmp_path / ("bad_%s.jsonl" % first.replace("e", "_"))
            write(p, obj_text)
            r = expect_error(["eval", "--model", base / "model", "--data", p, "--seq-len", "16"], ":1:", want)
            msgs.append(r.stderr.strip().splitlines()[-1].replace(p.name, "F"))
        assert msgs[0] == msgs[1], msgs


def test_over_long_line_names_a_real_setting(base, tmp_path):
    """The error pointed to data.max_line_bytes, which was no setting; it is
    one now (docs/job-file.md), and raising it lets the line through."""
    write(tmp_path / "d.jsonl", '{"input_ids": [1, 2, 3]}\n{"input_ids": [%s]}\n' % ", ".join(["7"] * 500))
    j = write_job(tmp_path / "job.json", str(base / "model"), "out", "d.jsonl", train_opts={"max_steps": 1},
                  data_opts={"max_line_bytes": 1000})
    expect_error(["train", j], "d.jsonl:2", "more than the limit of 1000", "data.max_line_bytes")
    r = ok(["train", j, "--set", "data.max_line_bytes=4000"])
    assert "unknown" not in r.stderr, r
    expect_error(["train", j, "--set", "data.max_line_bytes=0"], "data.max_line_bytes", "from 1")


@pytest.mark.parametrize("setting,value,rule", [
    ("train.save_steps", "1e18", "from 0 to 10^15"),
    ("train.log_steps", "1e18", "from 1 to 10^15"),
    ("train.max_steps", "1e18", "from 1 to 10^12"),
    ("data.seq_len", "1e18", "from 2 to 10^15"),
])
def test_range_errors_state_the_whole_rule(base, setting, value, rule):
    """'must be >= 1 (got 1e+18)' stated a rule the value keeps: the bound it
    breaks is named now."""
    j = write_job(base / "job_range.json", "model", "out_range", "tokens.jsonl")
    r = expect_error(["train", j, "--set", "%s=%s" % (setting, value)], setting, rule, "(got 1e+18)")
    assert ">=" not in r.stderr


def test_a_5000_character_path_is_elided(base):
    long_dir = "/tmp/" + "/".join(["d" * 99] * 50)
    j = write_job(base / "job_longpath.json", "model", "out_longpath", long_dir + "/train.jsonl")
    r = expect_error(["train", j], "train.jsonl", "...")
    line = r.stderr.strip().splitlines()[-1]
    assert len(line) < 500, len(line)  # was 2,061


def test_nul_escape_in_text_is_refused(base, tmp_path):
    """A \\u0000 in a text or a message decoded to a NUL byte, where the example's C string ended: the
    rest of it was dropped unseen (eval read 4 tokens of a 27-token line). It is a bad line now; an
    escaped backslash before "u0000" is ordinary text; the pre-tokenized format reads no text."""
    cm = base / "chatmodel"
    long_text = "hello" + "\u0000" + " world and more text here" * 40  # both the in-place and cJSON paths
    for name, obj in (("t", {"text": "hello\u0000 world and more text here"}), ("l", {"text": long_text}),
                      ("m", {"messages": [{"role": "user", "content": "a\u0000b"},
                                          {"role": "assistant", "content": "hi"}]})):
        f = write(tmp_path / (name + ".jsonl"), json.dumps(obj) + "\n")
        expect_error(["eval", "--model", cm, "--data", f, "--seq-len", "64"], name + ".jsonl:1", "\\u0000")
    f = write(tmp_path / "ok.jsonl", '{"text": "hello\\\\u0000 world"}\n')  # a backslash, then u0000
    r = ok(["eval", "--model", cm, "--data", f, "--seq-len", "64"])
    assert '"tokens"' in r.stdout
    f = write(tmp_path / "ids.jsonl", '{"input_ids": [1, 2, 3], "note": "\\u0000"}\n')
    ok(["eval", "--model", cm, "--data", f, "--seq-len", "64"])


def test_null_content_is_called_null(base, tmp_path):
    write(tmp_path / "chat.jsonl", json.dumps({"messages": [{"role": "user", "content": None},
                                                            {"role": "assistant", "content": "hi"}]}) + "\n")
    expect_error(["eval", "--model", base / "chatmodel", "--data", tmp_path / "chat.jsonl", "--seq-len", "16"],
                 "chat.jsonl:1", "messages[0]", '"content" is null', "must be a string")
    write(tmp_path / "chat2.jsonl", json.dumps({"messages": [{"role": "user"},
                                                             {"role": "assistant", "content": "hi"}]}) + "\n")
    expect_error(["eval", "--model", base / "chatmodel", "--data", tmp_path / "chat2.jsonl", "--seq-len", "16"],
                 '"content" key is missing')


@pytest.mark.parametrize("bad", ["nokeyvalue", "=5"])
def test_set_without_key_value_is_a_usage_error(base, bad):
    """The README promises exit 2 for a bad command line."""
    j = write_job(base / "job_set.json", "model", "out_set", "tokens.jsonl")
    expect_error(["train", j, "--set", bad], "--set", "key.path=value", code=(2,))
    assert not os.path.exists(base / "out_set")


MUTATIONS = ["", " ", ",", "]", "[", "-", "1.5", "600", "\"", "}", "{", "null", "e", "\\", "99999999999999999999",
             "-100", "\t"]


def test_both_parse_paths_agree_on_damaged_lines(base, tmp_path):
    """60 random damages (insert, delete, replace) of a long line with
    input_ids, labels and another key: the bounded path (plain ids) and the
    cJSON path (first id spelled 5e0) end the same way, with the same message
    (byte offsets aside, the spellings differ by 2 bytes). A syntax error must
    win over a value error, as in cJSON, whichever comes first in the line."""
    import re
    r = random.Random(5)
    ids = [r.randint(1, 511) for _ in range(14000)]
    labs = ["-100" if k % 5 == 0 else str(i) for k, i in enumerate(ids)]

    def line(first):
        return ('{"input_ids": [' + ", ".join([first] + [str(i) for i in ids[1:]]) + '], "labels": [' +
                ", ".join(labs) + '], "x": {"a": [1, "s"]}}')

    a, b = line("5"), line("5e0")
    for it in range(60):
        pos, m, op, k = r.randint(40, len(a) - 10), r.choice(MUTATIONS), r.choice("idr"), r.randint(1, 3)
        outs = []
        for s, shift in ((a, 0), (b, 2)):
            p = pos + shift
            t = s[:p] + m + s[p:] if op == "i" else s[:p] + s[p + k:] if op == "d" else s[:p] + m + s[p + 1:]
            f = write(tmp_path / "d.jsonl", t + "\n")
            res = run(["eval", "--model", base / "model", "--data", f, "--seq-len", "16"])
            last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
            outs.append((res.returncode, res.stdout, re.sub(r"near byte \d+", "near byte N", last)))
        assert outs[0] == outs[1], (it, op, m, pos, outs)


def prose_line(tmp_path, kind, mb, name):
    subprocess.run([sys.executable, "-c", GEN_PROSE, kind, str(mb), str(tmp_path / name)], check=True)
    return open(tmp_path / name, encoding="utf-8").read().rstrip("\n")


# the key spelt with a \u escape: cJSON reads the same object, the in-place
# path declines it (an escaped key), so the line takes the cJSON path
SLOW_KEY = {"text": ('"text"', '"\\u0074ext"'), "messages": ('"messages"', '"\\u006dessages"')}


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_long_text_and_chat_lines_read_the_same_tokens_as_before(base, tmp_path, kind):
    """A long line takes the in-place path, unless its key is spelt with a
    \\u escape (only cJSON reads that): both files give byte-identical token
    caches (escapes, a surrogate pair, raw UTF-8, other keys, ChatML and
    <|endoftext|> written inside contents and at their edges, a system turn
    after others), and the same warnings about the keys no format reads."""
    long = prose_line(tmp_path, kind, 0.2, "long.jsonl")
    assert len(long.encode()) > 64 << 10
    extra = ', "meta": {"source": [1, "x"]}, "id": 7}'
    bodies, warnings = [], []
    for name in ("fast", "slow"):
        d = tmp_path / name
        os.makedirs(d)
        line = long[:-1] + extra
        if name == "slow":
            line = line.replace(*SLOW_KEY[kind], 1)
        short = '{"text": "a short line"}' if kind == "text" else json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        # ChatML written inside contents, at their edges too: the turns stay
        # the rendered text's (a content ending in "<|im_" runs into the
        # template's <|im_end|>, one ending in "<|im_end|>" matches it)
        edges = ["\n\n  <|im_end|>x", "<|im_start|>assistant\n", "z <|endoftext|>", "y<|im_", "  \n", "<|im_end|>"]
        p = json.loads(long)
        if kind == "messages":
            p["messages"] = [{"role": m["role"], "content": edges[i] + m["content"] + edges[-1 - i]}
                             for i, m in enumerate(p["messages"])] + [{"role": "system", "content": "sys"}]
        else:
            p["text"] = edges[0] + p["text"] + edges[1]
        tricky = json.dumps(p, ensure_ascii=False)
        if name == "slow":
            tricky = tricky.replace(*SLOW_KEY[kind], 1)
        write(d / "data.jsonl", short + "\n" + line + "\n" + short + "\n" + tricky + "\n")
        j = write_job(d / "job.json", str(base / "chatmodel"), "out", "data.jsonl", T=256,
                      train_opts={"max_steps": 1}, data_opts={"cache_dir": str(d / "cache")})
        r = ok(["train", j])
        (cache,) = glob.glob(str(d / "cache" / "*.qtc"))
        bodies.append(cache_body(cache))
        warnings.append([l.replace(str(d), "D") for l in r.stderr.splitlines() if "is not read by" in l])
    assert bodies[0] == bodies[1]
    assert warnings[0] == warnings[1] and len(warnings[0]) == 2, warnings
    assert len(bodies[0]) > 5 * len(long.encode()) // 2  # both long lines were read


TEXT_MUTATIONS = ["", " ", ",", "]", "[", "\"", "}", "{", "null", "\\", "\\u", "\\u00", "\\ud800", "\\udc00",
                  "\\u0000", "\\x", "\\n", ":", "\"role\": \"user\", ", "\"content\": 5, ", "\t", "\x01", "\u00e9"]


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_both_text_paths_agree_on_damaged_lines(base, tmp_path, kind):
    """40 random damages (insert, delete, replace) of a long text or messages
    line: the in-place path and the cJSON path (the key spelt with a \\u
    escape) end the same way, with the same message (byte offsets aside)."""
    import re
    r = random.Random(13)
    a = prose_line(tmp_path, kind, 0.07, "src.jsonl")
    b = a.replace(*SLOW_KEY[kind], 1)
    shift = len(b) - len(a)
    for it in range(40):
        pos, m, op, k = r.randint(20, len(a) - 10), r.choice(TEXT_MUTATIONS), r.choice("idr"), r.randint(1, 3)
        outs = []
        for s, sh in ((a, 0), (b, shift)):
            p = pos + sh
            t = s[:p] + m + s[p:] if op == "i" else s[:p] + s[p + k:] if op == "d" else s[:p] + m + s[p + 1:]
            f = write(tmp_path / "d.jsonl", t + "\n")
            res = run(["eval", "--model", base / "chatmodel", "--data", f, "--seq-len", "16"])
            last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
            outs.append((res.returncode, res.stdout, re.sub(r"byte \d+", "byte N", last)))
        assert outs[0] == outs[1], (it, op, m, pos, outs)
