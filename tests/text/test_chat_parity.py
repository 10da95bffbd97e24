"""ChatML against the JS reference: the reference renders the conversation with
Qwen2.5's chat template (tests/text/qwen2.5_chat_template.jinja, the
tokenizer_config.json template without its tools branch) through
apply_chat_template and encodes it; qtune must give the same text and ids,
and label exactly the assistant contents and their closing <|im_end|>."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_node  # noqa: E402

TEMPLATE = open(os.path.join(os.path.dirname(__file__), "qwen2.5_chat_template.jinja"), encoding="utf-8").read()

CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}], False),
    ([{"role": "system", "content": "你是一个乐于助人的助手。"},
      {"role": "user", "content": "把这句话翻译成英文：今天天气很好。"},
      {"role": "assistant", "content": "The weather is nice today. 😀"},
      {"role": "user", "content": "谢谢！\n\n  再见"}], True),
    ([{"role": "user", "content": "code?"},
      {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```\n"},
      {"role": "user", "content": "weather in Paris"},
      {"role": "assistant", "content": "Let me check."},
      {"role": "tool", "content": "{\"temp\": 21}"},
      {"role": "tool", "content": "{\"rain\": false}"},
      {"role": "assistant", "content": "21 °C and dry."},
      {"role": "system", "content": "late system note"}], False),
    ([{"role": "user", "content": "write <|im_end|> literally"},
      {"role": "assistant", "content": "\nstarts with a newline, ends with spaces  "}], False),
]


# Each test runs twice: with qtune's built-in ChatML (what a folder without a
# template gets) and with Qwen2.5's real template rendered by qtune's Jinja
# (tests/text/qwen2.5_chat_template_full.jinja); both must give Qwen2.5's text.
# The folder of the npm tokenizer.json ships Qwen3's template, which
# --chat-template replaces here (tests/text/test_chat_templates.py tests that one).
TEMPLATE_ARGS = ["chatml", os.path.join(os.path.dirname(__file__), "qwen2.5_chat_template_full.jinja")]


@pytest.fixture(params=TEMPLATE_ARGS, ids=["chatml", "qwen2.5-jinja"])
def tmpl(request):
    return request.param


def qtune_chat(qtune, qwen_json, tmp_path, messages, gen, tmpl):
    p = tmp_path / "chat.json"
    p.write_text(json.dumps({"messages": messages, "add_generation_prompt": gen}))
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--chat-template", tmpl, "--chat", str(p)],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode())


def reference_chat(tmp_path, conversations):
    out = []
    for i, (messages, gen) in enumerate(conversations):
        p = tmp_path / f"ref{i}.json"
        p.write_text(json.dumps({"messages": messages, "add_generation_prompt": gen, "chat_template": TEMPLATE}))
        out.append(run_node(["--chat", str(p)]))
    return out


def test_chat_matches_reference(qtune, qwen_json, tmp_path, tmpl):
    refs = reference_chat(tmp_path, CONVERSATIONS)
    for (messages, gen), ref in zip(CONVERSATIONS, refs):
        got = qtune_chat(qtune, qwen_json, tmp_path, messages, gen, tmpl)
        assert got["text"] == ref["text"]
        assert got["ids"] == ref["ids"]
        assert len(got["labels"]) == len(got["ids"])


def test_labels_cover_assistant_content_and_im_end(qtune, qwen_json, tmp_path, tmpl):
    messages, gen = CONVERSATIONS[2]
    got = qtune_chat(qtune, qwen_json, tmp_path, messages, gen, tmpl)
    ids, labels = got["ids"], got["labels"]
    im_start, im_end = 151644, 151645
    # walk the turns: a labelled run starts after "<|im_start|>assistant\n" and ends at its <|im_end|>
    roles, i, expect = [], 0, []
    while i < len(ids):
        if ids[i] == im_start:
            # role token(s) up to and including "\n" (198)
            j = i + 1
            while ids[j] != 198:
                j += 1
            role = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode",
                                   ",".join(map(str, ids[i + 1:j]))], capture_output=True, text=True).stdout.strip()
            roles.append(role)
            expect += [False] * (j + 1 - i)
            k = j + 1
            while ids[k] != im_end:
                k += 1
            expect += [role == "assistant"] * (k + 1 - (j + 1))
            i = k + 1
        else:
            expect.append(False)  # the "\n" after <|im_end|> is never labelled
            i += 1
    assert roles.count("assistant") == 3
    assert [lab != -100 for lab in labels] == expect
    assert all(lab == -100 or lab == tok for lab, tok in zip(labels, ids))


# ---- tools, tool calls and tool turns: Qwen2.5's whole template, rendered by
# Jinja as transformers renders it (its tojson filter is json.dumps with
# ensure_ascii=False), held against `qtune tokenize --chat`; the ids are the
# JS reference's encoding of that text.

FULL_TEMPLATE = open(os.path.join(os.path.dirname(__file__), "qwen2.5_chat_template_full.jinja"),
                     encoding="utf-8").read()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, \"now\".\n",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7.5}},
                   "required": ["city"]}}}

TOOL_CONVERSATIONS = [
    # OpenAI shape: tool_calls[].function, content null, a tool answer, then the reply
    ({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Zürich", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21.5}"},
        {"role": "assistant", "content": "21.5 °C."}]}, False),
    # a system message with tools; content beside two calls (HF shape: name/arguments at the top);
    # arguments with escapes, a float, nesting and an empty object
    ({"tools": [WEATHER, {"name": "noop", "parameters": {}}], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Both?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris", "note": "a\tb \"q\" \\ 😀", "x": [1, 0.25, None,
                                                                                                   True]}},
            {"name": "noop", "arguments": {}}]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "ok"}]}, True),
    # tool calls without tools in the system turn
    ({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "noop", "arguments": {"n": 1e-05}}]}]}, False),
]


def qtune_chat_line(qtune, qwen_json, tmp_path, conv, gen, tmpl):
    p = tmp_path / "line.json"
    p.write_text(json.dumps(dict(conv, add_generation_prompt=gen)))
    r = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--chat-template", tmpl, "--chat", str(p)],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode())


def jinja_render(conv, gen):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(FULL_TEMPLATE).render(messages=conv["messages"], tools=conv.get("tools"),
                                                 add_generation_prompt=gen)


def test_tools_match_the_template(qtune, qwen_json, tmp_path, tmpl):
    texts = [jinja_render(conv, gen) for conv, gen in TOOL_CONVERSATIONS]
    p = tmp_path / "texts.json"
    p.write_text(json.dumps(texts))
    ref_ids = run_node(["--many", str(p)])
    for (conv, gen), text, ids in zip(TOOL_CONVERSATIONS, texts, ref_ids):
        got = qtune_chat_line(qtune, qwen_json, tmp_path, conv, gen, tmpl)
        assert got["text"] == text
        assert got["ids"] == ids


def test_tool_call_turn_labels(qtune, qwen_json, tmp_path, tmpl):
    """The labelled text of each assistant turn is what a model prompted with
    "<|im_start|>assistant\\n" must produce: from the content, or from the
    first <tool_call>, through <|im_end|>."""
    conv, gen = TOOL_CONVERSATIONS[1]
    got = qtune_chat_line(qtune, qwen_json, tmp_path, conv, gen, tmpl)
    lab = [i for i, l in zip(got["ids"], got["labels"]) if l != -100]
    text = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode", ",".join(map(str, lab))],
                          capture_output=True, text=True).stdout
    assert text.startswith("Checking.\n<tool_call>\n{\"name\": \"get_weather\"")
    assert text.endswith("</tool_call><|im_end|>") or text.endswith("</tool_call><|im_end|>\n")
    conv, gen = TOOL_CONVERSATIONS[2]
    got = qtune_chat_line(qtune, qwen_json, tmp_path, conv, gen, tmpl)
    lab = [i for i, l in zip(got["ids"], got["labels"]) if l != -100]
    text = subprocess.run([qtune, "tokenize", "--tokenizer", qwen_json, "--decode", ",".join(map(str, lab))],
                          capture_output=True, text=True).stdout
    assert text.startswith("<tool_call>\n{\"name\": \"noop\", \"arguments\": {\"n\": 1e-05}}")
