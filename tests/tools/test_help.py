"""Every command's --help names every option its parser takes (src/cli/cmd_*.c), and the lines that
were found untrue say what the code does."""
import json

import pytest

from conftest import qtune

# the options each command's parser accepts
OPTIONS = {
    "init": ["--out", "--preset", "--config", "--dtype", "--seed", "--tokenizer", "--force"],
    "train": ["--set"],
    "eval": ["--model", "--adapter", "--tokenizer", "--data", "--format", "--seq-len", "--batch", "--per-token",
             "--device"],
    "generate": ["--model", "--adapter", "--tokenizer", "--prompt", "--prompt-ids", "--prompts", "--chat",
                 "--system", "--max-new", "--temperature", "--top-k", "--top-p", "--seed", "--ctx", "--batch",
                 "--json", "--device"],
    "tokenize": ["--tokenizer", "--text", "--file", "--decode", "--chat", "--json"],
    "merge": ["--model", "--adapter", "--out", "--dtype", "--device"],
    "export": ["--model", "--adapter", "--gguf", "--gguf-lora", "--dtype"],
    "plan": ["--model", "--preset", "--set", "--mode", "--zero", "--devices", "--offload", "--reduce-bucket-size",
             "--allgather-bucket-size", "--overlap-comm", "--precision", "--micro-batch", "--seq-len",
             "--checkpointing", "--device-memory", "--lora-r", "--lora-targets", "--modules-to-save",
             "--card-watts", "--host-watts", "--cards-per-host", "--dataset-gib", "--strategies", "--device",
             "--backend", "--json"],
    "doctor": ["--set", "--ranks", "--no-table"],
    "stop": ["--wait"],
}


@pytest.mark.parametrize("cmd", sorted(OPTIONS))
def test_help_names_every_option(cmd):
    out = qtune(cmd, "--help", check=0).stdout
    for opt in OPTIONS[cmd]:
        assert opt in out, (cmd, opt)


def test_top_level_help_lists_every_command_and_quiet_logging():
    out = qtune("--help", check=0).stdout
    for cmd in OPTIONS:
        assert f"  {cmd} " in out, cmd
    assert "QTUNE_LOG=quiet" in out  # main.c reads it (warnings and errors only)


def test_generate_usage_line_names_prompt_ids():
    first = qtune("generate", "--help", check=0).stdout.split("\n\n")[0]
    assert "--prompt-ids LIST" in first, first


def test_doctor_ranks_default_is_the_local_rank_count():
    out = qtune("doctor", "--help", check=0).stdout
    assert "OMPI_COMM_WORLD_LOCAL_SIZE" in out and "world size" not in out, out


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen", "tiny-llama"])
def test_init_config_takes_what_help_says(tmp_path, preset):
    """--config reads Qwen3 and original Qwen config.json files too (the help said Qwen2/Llama only)."""
    assert "Qwen2, Qwen3, original Qwen or Llama" in qtune("init", "--help", check=0).stdout
    qtune("init", "--out", tmp_path / "a", "--preset", preset, check=0)
    qtune("init", "--out", tmp_path / "b", "--config", tmp_path / "a" / "config.json", check=0)
    a = json.loads((tmp_path / "a" / "config.json").read_text())
    b = json.loads((tmp_path / "b" / "config.json").read_text())
    assert a["architectures"] == b["architectures"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
