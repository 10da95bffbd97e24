"""qtune generate --prompts FILE takes {"messages": [...]} lines (issue 41 item 4), the form datasets and
OpenAI-style request files use: each is rendered with the chat template training uses and the assistant's
turn opened, exactly the ids `qtune tokenize --chat` gives with add_generation_prompt, and generated from
like a "prompt_ids" line of those ids. OpenAI's "developer" role is the system message. A malformed
messages line is named by file and line."""
import json
import os

from conftest import SRC, qtune

TINY_TOK = os.path.join(SRC, "fuzz", "corpus", "tokenizer", "tiny.json")


def test_messages_lines_are_chat_prompts(tmp_path):
    m = tmp_path / "m"
    qtune("init", "--out", m, "--preset", "tiny", "--seed", "2", "--tokenizer", TINY_TOK, check=0)
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello the"}]
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": convo, "add_generation_prompt": True}))
    want = json.loads(qtune("tokenize", "--tokenizer", m, "--chat", chat, check=0).stdout)["ids"]
    f = tmp_path / "prompts.jsonl"
    dev = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello the"}]
    f.write_text("\n".join(json.dumps(x) for x in [{"messages": convo}, {"prompt_ids": want}, {"messages": dev}]) + "\n")
    p = qtune("generate", "--model", m, "--prompts", f, "--max-new", 4, "--temperature", 0, "--json", check=0)
    out = [json.loads(l) for l in p.stdout.strip().splitlines()]
    assert [o["prompt_ids"] for o in out] == [want, want, want], p.stderr
    assert out[0]["ids"] == out[1]["ids"] == out[2]["ids"]
    # malformed lines: named by file and line
    for bad, words in [('{"messages": []}', "is empty"), ('{"messages": [{"role": "user"}]}', "messages[0] must be"),
                       ('{"messages": [{"role": "user", "content": "x"}], "prompt": "y"}', "one of the three")]:
        f.write_text('{"prompt_ids": [1]}\n' + bad + "\n")
        p = qtune("generate", "--model", m, "--prompts", f, "--max-new", 2)
        assert p.returncode == 1 and f"{f} line 2" in p.stderr and words in p.stderr, (bad, p.stderr)
