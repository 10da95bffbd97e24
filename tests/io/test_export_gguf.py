"""qtune export --gguf / --gguf-lora: every file is read back with the
independent reader in gguf_reader.py (written from the GGUF specification)
and checked against the safetensors source: llama.cpp's tensor names, shapes
(ne innermost first), types, metadata (hyperparameters, tokenizer, special
ids, chat template) and values; q8_0 against the format's rounding rule; the
adapter merged, or written as llama.cpp's LoRA GGUF. Hostile inputs end in one
clear sentence and leave nothing half-written."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(SRC, "tests", "ref"))
sys.path.insert(0, os.path.join(SRC, "tests", "text"))
import st  # noqa: E402
from byte_level import bytes_to_unicode  # noqa: E402
from gguf_reader import GGML_BF16, GGML_F16, GGML_F32, GGML_Q8_0, read_gguf  # noqa: E402

QTUNE = os.environ.get("QTUNE_BIN", "")
TINY_TOK = os.path.join(SRC, "fuzz", "corpus", "tokenizer", "tiny.json")
TYPES = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16, "q8_0": GGML_Q8_0}


def qtune(*args, check=0):
    if not QTUNE or not os.path.exists(QTUNE):
        pytest.skip("QTUNE_BIN is not set to a built qtune binary (run through ctest)")
    p = subprocess.run([QTUNE, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    out = {}
    for preset in ("tiny", "tiny-llama", "tiny-qwen3"):
        m = d / preset
        qtune("init", "--out", m, "--preset", preset, "--seed", "5", "--tokenizer", TINY_TOK)
        out[preset] = m
    return out


def hf_to_gguf(name):
    g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
    if name in g:
        return g[name]
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    for x in "qkv":
        for s in ("weight", "bias"):
            layer[f"self_attn.{x}_proj.{s}"] = f"attn_{x}.{s}"
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}.{layer[rest]}"


def rope_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows to ggml's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected(name, w, cfg):
    """The source tensor as llama.cpp's converter would store it (before the type cast)."""
    if cfg["architectures"][0] == "LlamaForCausalLM":
        if ".q_proj." in name:
            return rope_permute(w, cfg["num_attention_heads"])
        if ".k_proj." in name:
            return rope_permute(w, cfg["num_key_value_heads"])
    return w


def to_f16(x):
    return x.astype(np.float16).astype(np.float32)


def to_bf16(x):
    return st.bf16_to_f32(st.f32_to_bf16(x))


def q8_0_ref(x):
    """ggml's quantize_row_q8_0_ref then dequantised, in numpy: d = amax/127, q = round-half-away(x/d)."""
    b = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    v = b * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape), d


def check_values(gname, t, want, dtype, two_d):
    if not two_d or dtype == "f32":
        assert t.type == GGML_F32, gname
        assert np.array_equal(t.array, want), gname
    elif dtype == "f16" or (dtype == "q8_0" and want.shape[-1] % 32):
        assert t.type == GGML_F16, gname
        assert np.array_equal(t.array, to_f16(want)), gname
    elif dtype == "bf16":
        assert t.type == GGML_BF16, gname
        assert np.array_equal(t.array, to_bf16(want)), gname
    else:
        assert t.type == GGML_Q8_0, gname
        ref, d = q8_0_ref(want)
        # the format's error: half a step of the block's scale d, plus the 127 steps at most by which the
        # stored fp16 scale differs from d (the values are rounded against d, then stored with fp16(d))
        d16 = d.astype(np.float16).astype(np.float32)
        bound = np.repeat(0.5 * d + 127 * np.abs(d - d16), 32, axis=1).reshape(want.shape)
        assert np.all(np.abs(t.array - want) <= bound * (1 + 1e-5)), gname
        # and ggml's rounding itself: at most a tie (x / d within float32 rounding of a half) rounds the
        # other way, one step
        step = np.repeat(d16, 32, axis=1).reshape(want.shape)
        assert np.mean(t.array == ref) > 0.999, gname
        assert np.all(np.abs(t.array - ref) <= step * 1.0001), gname


def looks_special(t):
    """convert_hf_to_gguf.py's does_token_look_special: an added token spelled like a control token is
    typed CONTROL even when tokenizer.json says "special": false."""
    return (t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<|") and t.endswith("|>"))
            or (t.startswith("<\uff5c") and t.endswith("\uff5c>")) or (t.startswith("<unused") and t.endswith(">")))


def check_model(path, model_dir, dtype, merged=None):
    g = read_gguf(path)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    tc = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
    arch = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[
        cfg["architectures"][0]]
    kv = g.kv
    assert kv["general.architecture"] == arch and kv["general.type"] == "model"
    assert kv["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[dtype]
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    D = cfg.get("head_dim", C // H)  # Qwen3 sets it on its own (tiny-qwen3: 32 against 64 / 4)
    want_hp = {"attention.key_length": D, "attention.value_length": D, "context_length": cfg["max_position_embeddings"], "embedding_length": C,
               "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
               "attention.head_count": H, "attention.head_count_kv": cfg["num_key_value_heads"],
               "rope.dimension_count": D, "vocab_size": cfg["vocab_size"]}
    for k, v in want_hp.items():
        assert kv[f"{arch}.{k}"] == v, k
    assert np.float32(kv[f"{arch}.rope.freq_base"]) == np.float32(cfg["rope_theta"])
    assert np.float32(kv[f"{arch}.attention.layer_norm_rms_epsilon"]) == np.float32(cfg["rms_norm_eps"])
    # tokenizer: every id below vocab_size, types, merges, special ids, template
    V = cfg["vocab_size"]
    toks, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(toks) == len(types) == V
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    added = {a["id"]: a for a in tok["added_tokens"]}
    for s, i in tok["model"]["vocab"].items():
        assert toks[i] == s and types[i] == 1
    for i, a in added.items():
        assert toks[i] == a["content"] and types[i] == (3 if a["special"] or looks_special(a["content"]) else 4)
    for i in range(V):
        if i not in added and toks[i].startswith("[PAD"):
            assert toks[i] == f"[PAD{i}]" and types[i] == 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert kv["tokenizer.ggml.merges"] == merges
    ids = {a["content"]: i for i, a in added.items()}
    assert kv["tokenizer.ggml.eos_token_id"] == ids[tc["eos_token"]]
    assert kv["tokenizer.ggml.padding_token_id"] == ids[tc["pad_token"]]
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"] == tc["chat_template"]
    # tensors: every source weight under its llama.cpp name, nothing else
    src = st.read(os.path.join(model_dir, "model.safetensors"))
    if merged:
        src.update(merged)
    assert set(g.tensors) == {hf_to_gguf(n) for n in src}
    assert g.order[0] == "token_embd.weight"
    for name, w in src.items():
        gname = hf_to_gguf(name)
        t = g.tensors[gname]
        assert t.ne == tuple(reversed(w.shape)), gname
        check_values(gname, t, expected(name, w.astype(np.float32), cfg), dtype, w.ndim == 2)
    return g


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_model_roundtrip(models, tmp_path, preset, dtype):
    out = tmp_path / "m.gguf"
    p = qtune("export", "--model", models[preset], "--gguf", out, "--dtype", dtype)
    assert f"wrote {out}" in p.stdout
    check_model(out, models[preset], dtype)
    assert os.listdir(tmp_path) == ["m.gguf"]  # no temporary left


def test_default_dtype_is_the_models(tmp_path):
    m = tmp_path / "m"
    qtune("init", "--out", m, "--preset", "tiny", "--seed", "2", "--dtype", "bf16", "--tokenizer", TINY_TOK)
    out = tmp_path / "m.gguf"
    qtune("export", "--model", m, "--gguf", out)
    g = check_model(out, m, "bf16")
    assert g.tensors["blk.0.attn_q.weight"].type == GGML_BF16


def write_adapter(d, cfg, r=4, alpha=16.0, rslora=False, targets=("q_proj", "k_proj", "v_proj", "down_proj"),
                  seed=0):
    """A PEFT adapter with random non-zero A and B, written as peft does."""
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    C, I, H = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    D = cfg.get("head_dim", C // H)
    KV = cfg["num_key_value_heads"] * D
    dims = {"q_proj": ("self_attn", C, H * D), "k_proj": ("self_attn", C, KV), "v_proj": ("self_attn", C, KV),
            "o_proj": ("self_attn", H * D, C), "gate_proj": ("mlp", C, I), "up_proj": ("mlp", C, I),
            "down_proj": ("mlp", I, C)}
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            blk, n_in, n_out = dims[m]
            k = f"base_model.model.model.layers.{layer}.{blk}.{m}"
            t[k + ".lora_A.weight"] = rng.normal(0, 0.2, (r, n_in)).astype(np.float32)
            t[k + ".lora_B.weight"] = rng.normal(0, 0.2, (n_out, r)).astype(np.float32)
    st.write(os.path.join(d, "adapter_model.safetensors"), t)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "use_rslora": rslora,
               "target_modules": list(targets), "bias": "none", "task_type": "CAUSAL_LM"},
              open(os.path.join(d, "adapter_config.json"), "w"))
    return t


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen3"])
def test_merged_model(models, tmp_path, preset):
    m = models[preset]
    cfg = json.load(open(os.path.join(m, "config.json")))
    ad = write_adapter(tmp_path / "ad", cfg, rslora=preset == "tiny")
    scaling = 16.0 / (np.sqrt(4) if preset == "tiny" else 4)
    base = st.read(os.path.join(m, "model.safetensors"))
    merged = {}
    for k in ad:
        if k.endswith("lora_A.weight"):
            w = k[len("base_model.model."):-len(".lora_A.weight")] + ".weight"
            b = ad[k.replace("lora_A", "lora_B")].astype(np.float64)
            merged[w] = (base[w] + (b @ ad[k].astype(np.float64)) * scaling).astype(np.float32)
    out = tmp_path / "merged.gguf"
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf", out, "--dtype", "f32")
    assert "merged with" in p.stdout
    # merge.c computes in f32 with a different summation order: compare at f32 rounding
    g = read_gguf(out)
    for w, want in merged.items():
        got = g.tensors[hf_to_gguf(w)].array
        assert np.allclose(got, expected(w, want, cfg), rtol=1e-5, atol=1e-6), w
        assert not np.allclose(got, expected(w, base[w], cfg), atol=1e-4), w
    # and qtune merge's folder exports to the same file, byte for byte in the tensors
    qtune("merge", "--model", m, "--adapter", tmp_path / "ad", "--out", tmp_path / "mf")
    out2 = tmp_path / "mf.gguf"
    qtune("export", "--model", tmp_path / "mf", "--gguf", out2, "--dtype", "f32")
    g2 = read_gguf(out2)
    for n, t in g.tensors.items():
        assert t.raw == g2.tensors[n].raw, n


@pytest.mark.parametrize("preset,rslora,dtype", [("tiny", False, "f32"), ("tiny", True, "f16"),
                                                 ("tiny-llama", False, "bf16"), ("tiny-qwen3", False, "f32")])
def test_lora_gguf(models, tmp_path, preset, rslora, dtype):
    m = models[preset]
    cfg = json.load(open(os.path.join(m, "config.json")))
    ad = write_adapter(tmp_path / "ad", cfg, r=4, alpha=16.0, rslora=rslora)
    out = tmp_path / "lora.gguf"
    qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", out, "--dtype", dtype)
    g = read_gguf(out)
    arch = {"tiny": "qwen2", "tiny-llama": "llama", "tiny-qwen3": "qwen3"}[preset]
    assert g.kv["general.architecture"] == arch
    assert g.kv["general.type"] == "adapter" and g.kv["adapter.type"] == "lora"
    # llama.cpp scales by alpha / r: rsLoRA's alpha / sqrt(r) is written as alpha * sqrt(r)
    alpha = g.kv["adapter.lora.alpha"]
    assert np.isclose(alpha / 4, 16.0 / (np.sqrt(4) if rslora else 4), rtol=1e-6)
    assert len(g.tensors) == len(ad)
    conv = {"f32": lambda x: x, "f16": to_f16, "bf16": to_bf16}[dtype]
    for k, v in ad.items():
        base = k[len("base_model.model."):].replace(".lora_A", "").replace(".lora_B", "")
        is_b = ".lora_B." in k
        gname = hf_to_gguf(base) + (".lora_b" if is_b else ".lora_a")
        t = g.tensors[gname]
        assert t.type == TYPES[dtype]
        assert t.ne == tuple(reversed(v.shape))  # lora_a ne (in, r), lora_b ne (r, out), as llama.cpp checks
        want = expected(base, v, cfg) if is_b else v  # B's rows are W's rows: permuted with them (llama)
        assert np.array_equal(t.array, conv(want)), gname
    if preset == "tiny-llama":
        kq = "blk.0.attn_q.weight.lora_b"
        src = ad["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        assert not np.array_equal(g.tensors[kq].array, src)  # the permutation did something


def test_llama_permutation_is_the_rope_layout(models, tmp_path):
    """The permuted q rows turn HF's rotate-half pairs (i, i + D/2) into ggml's (2i, 2i + 1): row 1 of head 0
    in the file is HF row D/2."""
    m = models["tiny-llama"]
    cfg = json.load(open(os.path.join(m, "config.json")))
    out = tmp_path / "l.gguf"
    qtune("export", "--model", m, "--gguf", out, "--dtype", "f32")
    g = read_gguf(out)
    w = st.read(os.path.join(m, "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    D = cfg["hidden_size"] // cfg["num_attention_heads"]
    got = g.tensors["blk.0.attn_q.weight"].array
    assert np.array_equal(got[0], w[0]) and np.array_equal(got[1], w[D // 2]) and np.array_equal(got[2], w[1])
    assert np.array_equal(got[D + 1], w[D + D // 2])


# ---- hostile inputs ---------------------------------------------------------------------------------
def no_leftovers(d, allowed=()):
    left = [f for f in os.listdir(d) if f not in allowed]
    assert not left, left


def test_errors(models, tmp_path):
    m = models["tiny"]
    out = tmp_path / "x.gguf"
    p = qtune("export", "--model", m, "--adapter", tmp_path / "nope", "--gguf", out, check=1)
    assert "nope" in p.stderr and "adapter_config.json" in p.stderr
    p = qtune("export", "--model", m, "--gguf", out, "--dtype", "q4", check=2)
    assert "--dtype must be f32, f16, bf16 or q8_0" in p.stderr
    p = qtune("export", "--model", tmp_path / "nomodel", "--gguf", out, check=1)
    assert "nomodel does not exist" in p.stderr
    p = qtune("export", "--model", m, check=2)
    assert "--gguf" in p.stderr
    p = qtune("export", "--model", m, "--gguf", out, "--gguf-lora", out, check=2)
    p = qtune("export", "--model", m, "--gguf-lora", out, check=2)
    assert "--adapter" in p.stderr
    p = qtune("export", "--model", m, "--gguf", tmp_path, check=2)
    assert "is a folder" in p.stderr
    # a new folder for the output is made, as merge makes one (before: "cannot create")
    p = qtune("export", "--model", m, "--gguf", tmp_path / "no" / "dir" / "x.gguf")
    assert os.path.isfile(tmp_path / "no" / "dir" / "x.gguf"), p.stderr
    shutil.rmtree(tmp_path / "no")
    # one under a file cannot be made: named, and nothing is left
    (tmp_path / "afile").write_text("x")
    p = qtune("export", "--model", m, "--gguf", tmp_path / "afile" / "dir" / "x.gguf", check=1)
    assert "afile" in p.stderr, p.stderr
    os.remove(tmp_path / "afile")
    cfg = json.load(open(os.path.join(m, "config.json")))
    write_adapter(tmp_path / "ad", cfg)
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", out, "--dtype", "q8_0", check=1)
    assert "q8_0" in p.stderr
    no_leftovers(tmp_path, ("ad",))
    # a failed export removes the folders it made for its output
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", tmp_path / "new" / "sub" / "a.gguf",
              "--dtype", "q8_0", check=1)
    no_leftovers(tmp_path, ("ad",))


def test_added_tokens_typed_as_llama_cpp_converts_them(models, tmp_path):
    """Qwen2.5's tokenizer.json lists <|fim_prefix|> ... <|repo_name|>, <|file_sep|> with "special": false;
    convert_hf_to_gguf.py types them CONTROL (does_token_look_special), and llama.cpp warns about a
    USER_DEFINED token spelled <|...|> on every load. <tool_call> (not special, not <|...|>) stays
    USER_DEFINED."""
    m = tmp_path / "m"
    shutil.copytree(models["tiny"], m)
    tok = json.load(open(m / "tokenizer.json"))
    V = json.load(open(m / "config.json"))["vocab_size"]
    used = {a["id"] for a in tok["added_tokens"]} | set(tok["model"]["vocab"].values())
    free = [i for i in range(V) if i not in used]
    names = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
             "<tool_call>"]
    assert len(free) >= len(names)
    for i, n in zip(free, names):
        tok["added_tokens"].append({"id": i, "content": n, "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False, "special": False})
    json.dump(tok, open(m / "tokenizer.json", "w"))
    out = tmp_path / "m.gguf"
    qtune("export", "--model", m, "--gguf", out)
    kv = read_gguf(out).kv
    toks, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    for i, n in zip(free, names):
        assert toks[i] == n
        assert types[i] == (4 if n == "<tool_call>" else 3), n


def test_gguf_named_after_the_model_not_final(models, tmp_path):
    """general.name: a model folder's own name; a training run's final/ (or checkpoint-STEP) is named after
    the base model its qtune_run.json records and the run's folder, not "final"."""
    out = tmp_path / "a.gguf"
    qtune("export", "--model", models["tiny"], "--gguf", out)
    assert read_gguf(out).kv["general.name"] == "tiny"
    run = tmp_path / "myrun"
    run.mkdir()
    shutil.copytree(models["tiny"], run / "final")
    json.dump({"job": {"model": "../models/Qwen2.5-0.5B", "output_dir": "myrun"}}, open(run / "qtune_run.json", "w"))
    qtune("export", "--model", run / "final", "--gguf", out)
    assert read_gguf(out).kv["general.name"] == "Qwen2.5-0.5B-myrun"
    # without the run's record: the run's folder
    os.remove(run / "qtune_run.json")
    qtune("export", "--model", run / "final", "--gguf", out)
    assert read_gguf(out).kv["general.name"] == "myrun"


def test_unwritable_output_keeps_old_file(models, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    d = tmp_path / "ro"
    d.mkdir()
    (d / "x.gguf").write_bytes(b"old")
    os.chmod(d, 0o555)
    try:
        p = qtune("export", "--model", models["tiny"], "--gguf", d / "x.gguf", check=1)
        assert "cannot create" in p.stderr
        assert (d / "x.gguf").read_bytes() == b"old"
        no_leftovers(d, ("x.gguf",))
    finally:
        os.chmod(d, 0o755)


def test_failed_export_keeps_old_file(models, tmp_path):
    """An adapter whose shapes do not fit is refused before anything is written; the old file stays."""
    m = models["tiny"]
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old")
    cfg = dict(json.load(open(os.path.join(m, "config.json"))), hidden_size=32, num_attention_heads=2)
    write_adapter(tmp_path / "bad", cfg)
    p = qtune("export", "--model", m, "--adapter", tmp_path / "bad", "--gguf", out, check=1)
    assert "do not fit" in p.stderr
    assert out.read_bytes() == b"old"
    no_leftovers(tmp_path, ("x.gguf", "bad"))


def test_output_that_is_an_input_is_refused(models, tmp_path):
    """OUT naming a file the export reads (the model's safetensors or config, the adapter's weights) would be
    renamed over it, and the mapped input read to the end: the export succeeded and the model was gone."""
    import shutil
    m, ad = tmp_path / "m", tmp_path / "ad"
    shutil.copytree(models["tiny"], m)
    write_adapter(ad, json.load(open(m / "config.json")))
    before = {p: p.read_bytes() for p in [*m.iterdir(), *ad.iterdir()]}
    for args in (("--gguf", m / "model.safetensors"), ("--gguf", tmp_path / "." / "m" / "config.json"),
                 ("--adapter", ad, "--gguf", ad / "adapter_config.json"),
                 ("--adapter", ad, "--gguf-lora", ad / "adapter_model.safetensors")):
        p = qtune("export", "--model", m, *args, check=2)
        assert "is an input of the export" in p.stderr and "name a new .gguf file" in p.stderr, p.stderr
    assert {p: p.read_bytes() for p in [*m.iterdir(), *ad.iterdir()]} == before
    p = qtune("export", "--model", m, "--gguf", "", check=2)
    assert "--gguf needs the name of the .gguf file" in p.stderr
    qtune("export", "--model", m, "--gguf", m / "m.gguf")  # a new file in the model folder is fine
    qtune("export", "--model", m, "--gguf", m / "m.gguf")  # and so is replacing it
    no_leftovers(tmp_path, ("m", "ad"))


def with_scaling(src, tmp_path, scaling):
    import shutil
    m = tmp_path / "m"
    shutil.copytree(src, m)
    cfg = json.load(open(m / "config.json"))
    cfg["rope_scaling"] = scaling
    json.dump(cfg, open(m / "config.json", "w"))
    return m, cfg


# RoPE scaling as llama.cpp reads it (c392e50: llama-model.cpp's rope.scaling.* keys, ggml's rope_yarn, and
# the llama architecture's rope_freqs tensor): linear and YaRN as keys, llama3 as per-frequency divisors.
@pytest.mark.parametrize("preset,scaling,want", [
    ("tiny", {"type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
    ("tiny-llama", {"rope_type": "linear", "factor": 3.0}, {"type": "linear", "factor": 3.0}),
    ("tiny", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
     {"type": "yarn", "factor": 4.0, "original_context_length": 512}),
    # an attention factor of its own: ggml scales by attn_factor x (1 + 0.1 ln 4), so attn_factor = 1.3 / that
    ("tiny-qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                    "attention_factor": 1.3},
     {"type": "yarn", "factor": 4.0, "original_context_length": 256, "attn_factor": 1.3 / (1 + 0.1 * np.log(4.0))}),
])
def test_rope_scaling_keys(models, tmp_path, preset, scaling, want):
    m, cfg = with_scaling(models[preset], tmp_path, scaling)
    out = tmp_path / "x.gguf"
    qtune("export", "--model", m, "--gguf", out)
    kv = read_gguf(out).kv
    arch = {"tiny": "qwen2", "tiny-llama": "llama", "tiny-qwen3": "qwen3"}[preset]
    got = {k.split("rope.scaling.")[1]: v for k, v in kv.items() if k.startswith(f"{arch}.rope.scaling.")}
    assert set(got) == set(want), got
    for k, v in want.items():
        assert (got[k] == v) if isinstance(v, (str, int)) else np.float32(got[k]) == np.float32(v), (k, got[k], v)


def test_llama3_rope_freqs(models, tmp_path):
    """llama3's scaling is the rope_freqs tensor: each frequency's divisor, as convert_hf_to_gguf.py computes it
    (written here from its formula: 1 above the high-frequency wavelength, factor below the low one, the smooth
    mix between)."""
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    m, cfg = with_scaling(models["tiny-llama"], tmp_path, sc)
    out = tmp_path / "x.gguf"
    qtune("export", "--model", m, "--gguf", out)
    g = read_gguf(out)
    D = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    want = []
    for i in range(0, D, 2):
        freq = 1.0 / (cfg["rope_theta"] ** (i / D))
        wavelen = 2 * np.pi / freq
        if wavelen < 64 / 4.0:
            want.append(1.0)
        elif wavelen > 64 / 1.0:
            want.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / 8.0 + smooth))
    t = g.tensors["rope_freqs.weight"]
    assert t.type == GGML_F32 and list(t.ne) == [D // 2]
    assert np.array_equal(t.array, np.array(want, dtype=np.float32)), (t.array, want)
    assert 1.0 in want and 8.0 in want and any(1 < x < 8 for x in want)  # all three regimes occur
    assert not [k for k in g.kv if ".rope.scaling." in k]


@pytest.mark.parametrize("preset,scaling,words", [
    ("tiny", {"rope_type": "dynamic", "factor": 2.0}, "no dynamic NTK"),
    ("tiny", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}, "llama architecture only"),
    ("tiny", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16}, "beta_fast 32 and beta_slow 1"),
    ("tiny-llama", {"rope_type": "yarn", "factor": 4.0, "truncate": False}, "truncate false"),
])
def test_rope_scaling_llama_cpp_cannot_run_is_refused(models, tmp_path, preset, scaling, words):
    """Scaling llama.cpp would not apply as transformers does is refused, the old file kept: written anyway,
    llama.cpp would run another model with no word said."""
    m, _ = with_scaling(models[preset], tmp_path, scaling)
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old")
    p = qtune("export", "--model", m, "--gguf", out, check=1)
    assert "rope_scaling" in p.stderr and words in p.stderr and "convert_hf_to_gguf.py" in p.stderr, p.stderr
    assert out.read_bytes() == b"old"
    no_leftovers(tmp_path, ("m", "x.gguf"))


@pytest.mark.parametrize("value", ["true", 1])
def test_non_bool_rslora_is_refused(models, tmp_path, value):
    """PEFT reads a truthy use_rslora ("true", 1) as rsLoRA; qtune read it as false and scaled by alpha / r,
    a different adapter (--gguf-lora's alpha, the merged weights), with no word said."""
    m = models["tiny"]
    write_adapter(tmp_path / "ad", json.load(open(os.path.join(m, "config.json"))))
    c = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    c["use_rslora"] = value
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    for flag in ("--gguf", "--gguf-lora"):
        p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", flag, tmp_path / "x.gguf", check=1)
        assert "use_rslora\" must be true or false" in p.stderr, p.stderr
    no_leftovers(tmp_path, ("ad",))


@pytest.mark.parametrize("key,value,words", [
    ("init_lora_weights", "pissa_niter_16", "changed the base model's weights"),
    ("init_lora_weights", "olora", "changed the base model's weights"),
    ("init_lora_weights", "loftq", "changed the base model's weights"),
    ("exclude_modules", ["model.layers.0.self_attn.q_proj"], "exclude_modules is set"),
    ("layer_replication", [[0, 1], [0, 1]], "layer_replication is set"),
    ("use_qalora", True, "use_qalora is set"),
    ("alora_invocation_tokens", [1, 2], "alora_invocation_tokens is set"),
    ("target_parameters", ["mlp.experts.gate_up_proj"], "target_parameters is set"),
])
def test_adapter_keys_that_change_its_meaning_are_refused(models, tmp_path, key, value, words):
    """A saved adapter whose config changes what its weights mean (a base PEFT changed at init, layers
    left out or repeated, another forward) was read as a plain LoRA on the original model, silently."""
    m = models["tiny"]
    write_adapter(tmp_path / "ad", json.load(open(os.path.join(m, "config.json"))))
    c = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    c[key] = value
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    for flag in ("--gguf", "--gguf-lora"):
        p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", flag, tmp_path / "x.gguf", check=1)
        assert words in p.stderr and "adapter_config.json" in p.stderr, p.stderr
    no_leftovers(tmp_path, ("ad",))


def test_adapter_keys_at_harmless_values_and_unknown_keys(models, tmp_path):
    """init_lora_weights that only chose the starting point, and the newer keys at their defaults, export
    quietly; a key qtune does not know exports with a warning that names it."""
    m = models["tiny"]
    write_adapter(tmp_path / "ad", json.load(open(os.path.join(m, "config.json"))))
    c = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    c.update(init_lora_weights="gaussian", exclude_modules=None, layer_replication=None, use_qalora=False,
             alora_invocation_tokens=None, target_parameters=None, peft_version="0.17.0")
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", tmp_path / "a.gguf")
    assert "ignored" not in p.stderr, p.stderr
    c["lora_frobnicate"] = 3
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", tmp_path / "b.gguf")
    assert "\"lora_frobnicate\" is not a LoRA setting qtune knows and is ignored" in p.stderr, p.stderr
    assert p.stderr.count("lora_frobnicate") == 1, p.stderr  # the command reads the file twice; said once
    assert os.path.exists(tmp_path / "b.gguf")
    # a misspelt LoraConfig key names the key it is nearest to (issue 41)
    c.pop("lora_frobnicate")
    c["use_rslroa"] = False
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", tmp_path / "c.gguf")
    assert "\"use_rslroa\" is not a LoRA setting qtune knows and is ignored; did you mean \"use_rslora\"?" in p.stderr, \
        p.stderr


def test_unsupported_architecture_says_what_to_do(models, tmp_path):
    """Every architecture qtune loads is exported; any other is refused when its config.json is read,
    by a sentence that names what is supported."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(models["tiny"], m)
    cfg = json.load(open(m / "config.json"))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(m / "config.json", "w"))
    p = qtune("export", "--model", m, "--gguf", tmp_path / "x.gguf", check=1)
    assert "'MistralForCausalLM' is not supported" in p.stderr and "QWenLMHeadModel" in p.stderr, p.stderr
    no_leftovers(tmp_path, ("m",))


# ---- the original Qwen (QWenLMHeadModel, qwen.tiktoken) -> llama.cpp's arch "qwen" ----
QWEN1_WORDS = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" a", b" and", b"er", b"re",
               b"on", b"hel", b"ll", b"lo", b"llo", b"hello", b"\xe4\xbd", b"\xe4\xbd\xa0"]
QWEN1_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


def qwen1_bpe(ranks, token, max_rank):
    """convert_hf_to_gguf.py's QwenModel.bpe."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i, (a, b) in enumerate(zip(parts[:-1], parts[1:])):
            r = ranks.get(a + b)
            if r is not None and (best is None or r < best[1]):
                best = (i, r)
        if best is None or best[1] >= max_rank:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


@pytest.fixture(scope="module")
def qwen1(tmp_path_factory):
    """A tiny-qwen model with a small hand-made qwen.tiktoken: the 256 bytes (in a shuffled order, so rank is
    not byte value) and words each two lower-ranked tokens merged."""
    import base64
    m = tmp_path_factory.mktemp("qwen1") / "m"
    qtune("init", "--out", m, "--preset", "tiny-qwen", "--seed", "3")
    byts = list(range(256))
    np.random.default_rng(1).shuffle(byts)
    toks = [bytes([b]) for b in byts] + QWEN1_WORDS
    with open(m / "qwen.tiktoken", "w") as f:
        for i, t in enumerate(toks):
            f.write(f"{base64.b64encode(t).decode()} {i}\n")
    return m, toks


def check_qwen1(path, model_dir, toks, dtype):
    g = read_gguf(path)
    kv = g.kv
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert kv["general.architecture"] == "qwen" and kv["general.type"] == "model"
    assert kv["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[dtype]
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    # convert_hf_to_gguf.py's QwenModel: feed_forward_length is config.json's intermediate_size (llama.cpp halves
    # it); context_length is seq_length here, as use_dynamic_ntk / use_logn_attn are on and llama.cpp has neither
    assert cfg["use_dynamic_ntk"] and cfg["seq_length"] < cfg["max_position_embeddings"]
    want_hp = {"context_length": cfg["seq_length"], "embedding_length": C, "block_count": cfg["num_hidden_layers"],
               "feed_forward_length": cfg["intermediate_size"], "attention.head_count": H,
               "rope.dimension_count": C // H}
    for k, v in want_hp.items():
        assert kv[f"qwen.{k}"] == v, k
    assert np.float32(kv["qwen.rope.freq_base"]) == np.float32(cfg["rotary_emb_base"])
    assert np.float32(kv["qwen.attention.layer_norm_rms_epsilon"]) == np.float32(cfg["layer_norm_epsilon"])
    # _set_vocab_qwen: ranks in GPT-2's byte alphabet, the converter's one merge per token, specials CONTROL
    V = cfg["vocab_size"]
    enc = bytes_to_unicode()
    s = lambda b: "".join(enc[c] for c in b)  # noqa: E731
    ranks = {t: i for i, t in enumerate(toks)}
    want_toks = [s(t) for t in toks] + QWEN1_SPECIALS
    want_toks += [f"[PAD{i}]" for i in range(len(want_toks), V)]
    want_types = [1] * len(toks) + [3] * len(QWEN1_SPECIALS) + [5] * (V - len(toks) - len(QWEN1_SPECIALS))
    assert kv["tokenizer.ggml.tokens"] == want_toks
    assert kv["tokenizer.ggml.token_type"] == want_types
    want_merges = []
    for t, r in ranks.items():
        if len(t) > 1:
            parts = qwen1_bpe(ranks, t, r)
            assert len(parts) == 2
            want_merges.append(" ".join(map(s, parts)))
    assert kv["tokenizer.ggml.merges"] == want_merges
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    eot = len(toks)
    for k in ("bos", "eos", "unknown"):
        assert kv[f"tokenizer.ggml.{k}_token_id"] == eot, k
    assert kv["tokenizer.ggml.add_bos_token"] is False
    # tensors: llama.cpp's names for the original Qwen's, values unchanged (NeoX RoPE, c_attn kept fused)
    names = {"transformer.wte.weight": "token_embd.weight", "transformer.ln_f.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"ln_1.weight": "attn_norm.weight", "attn.c_attn.weight": "attn_qkv.weight",
             "attn.c_attn.bias": "attn_qkv.bias", "attn.c_proj.weight": "attn_output.weight",
             "ln_2.weight": "ffn_norm.weight", "mlp.w1.weight": "ffn_up.weight", "mlp.w2.weight": "ffn_gate.weight",
             "mlp.c_proj.weight": "ffn_down.weight"}
    src = st.read(os.path.join(model_dir, "model.safetensors"))
    for L in range(cfg["num_hidden_layers"]):
        for k, v in layer.items():
            names[f"transformer.h.{L}.{k}"] = f"blk.{L}.{v}"
    assert set(src) == set(names) and set(g.tensors) == set(names.values())
    I = cfg["intermediate_size"] // 2
    for name, w in src.items():
        t = g.tensors[names[name]]
        assert t.ne == tuple(reversed(w.shape)), name
        check_values(names[name], t, w.astype(np.float32), dtype, w.ndim == 2)
    # the shapes llama.cpp's LLM_ARCH_QWEN creates: wqkv {C, 3C}, ffn_gate/up {C, n_ff/2}, ffn_down {n_ff/2, C}
    assert g.tensors["blk.0.attn_qkv.weight"].ne == (C, 3 * C) and g.tensors["blk.0.attn_qkv.bias"].ne == (3 * C,)
    assert g.tensors["blk.1.ffn_up.weight"].ne == (C, I) == g.tensors["blk.1.ffn_gate.weight"].ne
    assert g.tensors["blk.1.ffn_down.weight"].ne == (I, C)
    return g


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_qwen1_model(qwen1, tmp_path, dtype):
    m, toks = qwen1
    out = tmp_path / "q.gguf"
    qtune("export", "--model", m, "--gguf", out, "--dtype", dtype)
    check_qwen1(out, m, toks, dtype)


def write_qwen1_adapter(d, cfg, r=4, alpha=8.0, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    C, I = cfg["hidden_size"], cfg["intermediate_size"] // 2
    dims = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.w1": (C, I), "mlp.w2": (C, I),
            "mlp.c_proj": (I, C)}
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (n_in, n_out) in dims.items():
            k = f"base_model.model.transformer.h.{layer}.{mod}"
            t[k + ".lora_A.weight"] = rng.normal(0, 0.2, (r, n_in)).astype(np.float32)
            t[k + ".lora_B.weight"] = rng.normal(0, 0.2, (n_out, r)).astype(np.float32)
    st.write(os.path.join(d, "adapter_model.safetensors"), t)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
               "target_modules": ["c_attn", "c_proj", "w1", "w2"], "bias": "none", "task_type": "CAUSAL_LM"},
              open(os.path.join(d, "adapter_config.json"), "w"))
    return t


def test_qwen1_lora_and_merged(qwen1, tmp_path):
    m, toks = qwen1
    cfg = json.load(open(m / "config.json"))
    ad = write_qwen1_adapter(tmp_path / "ad", cfg)
    out = tmp_path / "lora.gguf"
    qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", out)
    g = read_gguf(out)
    assert g.kv["general.architecture"] == "qwen" and g.kv["adapter.type"] == "lora"
    assert np.isclose(g.kv["adapter.lora.alpha"], 8.0)
    gn = {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.w1": "ffn_up", "mlp.w2": "ffn_gate",
          "mlp.c_proj": "ffn_down"}
    assert len(g.tensors) == len(ad)
    for k, v in ad.items():
        _, _, _, _, L, rest = k.split(".", 5)
        mod = rest.rsplit(".", 2)[0]
        gname = f"blk.{L}.{gn[mod]}.weight" + (".lora_b" if ".lora_B." in k else ".lora_a")
        assert g.tensors[gname].ne == tuple(reversed(v.shape)), gname
        assert np.array_equal(g.tensors[gname].array, v), gname
    # merged: qtune merge's folder (with the tokenizer copied) exports to the same tensors
    merged = tmp_path / "merged.gguf"
    qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf", merged, "--dtype", "f32")
    base = st.read(os.path.join(m, "model.safetensors"))
    gm = read_gguf(merged)
    w = "transformer.h.1.attn.c_attn"
    want = base[w + ".weight"] + (ad[f"base_model.model.{w}.lora_B.weight"].astype(np.float64) @
                                  ad[f"base_model.model.{w}.lora_A.weight"]) * 8.0 / 4
    assert np.allclose(gm.tensors["blk.1.attn_qkv.weight"].array, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(gm.tensors["blk.1.attn_qkv.bias"].array, base[w + ".bias"])


def test_qwen1_tied_writes_output_twice(qwen1, tmp_path):
    """llama.cpp's "qwen" has no tied fallback: a tied model's embedding is written as output.weight too."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(qwen1[0], m)
    cfg = json.load(open(m / "config.json"))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(m / "config.json", "w"))
    src = st.read(os.path.join(m, "model.safetensors"))
    del src["lm_head.weight"]
    st.write(os.path.join(m, "model.safetensors"), src)
    out = tmp_path / "t.gguf"
    qtune("export", "--model", m, "--gguf", out, "--dtype", "f16")
    g = read_gguf(out)
    assert g.tensors["output.weight"].raw == g.tensors["token_embd.weight"].raw
    assert np.array_equal(g.tensors["output.weight"].array, to_f16(src["transformer.wte.weight"]))


def test_missing_tokenizer(models, tmp_path):
    import shutil
    m = tmp_path / "m"
    shutil.copytree(models["tiny"], m)
    os.remove(m / "tokenizer.json")
    p = qtune("export", "--model", m, "--gguf", tmp_path / "x.gguf", check=1)
    assert "tokenizer.json is missing" in p.stderr
    no_leftovers(tmp_path, ("m",))


def test_memory_does_not_scale_with_the_model(tmp_path):
    """Streamed: a bf16 model exported to f32 needs neither an f32 copy (2x the source) nor the output in
    memory, and the source's mapped pages are handed back as they are consumed: the peak RSS stays under
    half the source file (19 MB for this 84 MB source when measured; 99 MB before the pages were released)."""
    m = tmp_path / "m"
    qtune("init", "--out", m, "--preset", "bench-tiny", "--seed", "1", "--dtype", "bf16")
    import shutil
    shutil.copy(TINY_TOK, m / "tokenizer.json")
    # the tiny tokenizer's 267 ids pad to the 151936-row vocabulary as [PAD<id>] tokens
    src_bytes = os.path.getsize(m / "model.safetensors")
    out = tmp_path / "m.gguf"
    # measured by /usr/bin/time, a small parent: a child forked from pytest starts with pytest's own pages
    # resident, and the peak RSS it reports keeps them across the exec
    if not os.path.exists("/usr/bin/time"):
        pytest.skip("/usr/bin/time is not installed")
    rss = tmp_path / "rss"
    p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss), QTUNE, "export", "--model", str(m), "--gguf",
                        str(out), "--dtype", "f32"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    peak = int(rss.read_text().split()[-1]) * 1024
    out_bytes = os.path.getsize(out)
    assert out_bytes > 1.9 * src_bytes
    assert peak < src_bytes / 2, (peak, src_bytes, out_bytes)


def test_interrupt_leaves_nothing(tmp_path):
    """Ctrl-C during the write: exit 130, the temporary removed, an old OUT untouched."""
    import signal
    import time
    m = tmp_path / "m"
    qtune("init", "--out", m, "--preset", "bench-tiny", "--seed", "1")
    import shutil
    shutil.copy(TINY_TOK, m / "tokenizer.json")
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old")
    p = subprocess.Popen([QTUNE, "export", "--model", str(m), "--gguf", str(out), "--dtype", "f32"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait until the temporary file exists (the write has begun), then interrupt
    t0 = time.time()
    while time.time() - t0 < 30 and not [f for f in os.listdir(tmp_path) if f.startswith("x.gguf.tmp")]:
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("the export finished before the signal arrived")
    assert p.returncode == 130, err
    assert "export interrupted" in err
    assert out.read_bytes() == b"old"
    no_leftovers(tmp_path, ("m", "x.gguf"))


def test_modules_to_save(models, tmp_path):
    """An adapter with PEFT's modules_to_save: export --gguf --adapter writes the trained embedding and lm_head
    (untied model) as qtune merge does; on a tied model (the merged model must be untied) it asks for merge
    first; --gguf-lora refuses the full tensors (llama.cpp's LoRA GGUF holds A/B only)."""
    m = models["tiny-llama"]
    cfg = json.load(open(os.path.join(m, "config.json")))
    ad = write_adapter(tmp_path / "ad", cfg, targets=("q_proj",))
    base = st.read(os.path.join(m, "model.safetensors"))
    rng = np.random.default_rng(9)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        ad["base_model.model." + k] = (base[k] + rng.normal(0, 0.1, base[k].shape)).astype(np.float32)
    st.write(os.path.join(tmp_path / "ad", "adapter_model.safetensors"), ad)
    c = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    c["modules_to_save"] = ["embed_tokens", "lm_head"]
    json.dump(c, open(tmp_path / "ad" / "adapter_config.json", "w"))
    out = tmp_path / "m.gguf"
    qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf", out, "--dtype", "f32")
    g = read_gguf(out)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert np.array_equal(g.tensors[hf_to_gguf(k)].array, expected(k, ad["base_model.model." + k], cfg)), k
    qtune("merge", "--model", m, "--adapter", tmp_path / "ad", "--out", tmp_path / "mf")
    qtune("export", "--model", tmp_path / "mf", "--gguf", tmp_path / "mf.gguf", "--dtype", "f32")
    g2 = read_gguf(tmp_path / "mf.gguf")
    for n, t in g.tensors.items():
        assert t.raw == g2.tensors[n].raw, n
    p = qtune("export", "--model", m, "--adapter", tmp_path / "ad", "--gguf-lora", tmp_path / "l.gguf", check=None)
    assert p.returncode != 0 and "modules_to_save" in p.stderr and "--gguf" in p.stderr, p.stderr
    # tied: the merged model is untied, which only qtune merge writes
    t = models["tiny"]
    tc = json.load(open(os.path.join(t, "config.json")))
    tad = write_adapter(tmp_path / "tad", tc, targets=("q_proj",))
    tb = st.read(os.path.join(t, "model.safetensors"))
    tad["base_model.model.lm_head.weight"] = tb["model.embed_tokens.weight"] + 0.5
    st.write(os.path.join(tmp_path / "tad", "adapter_model.safetensors"), tad)
    c = json.load(open(tmp_path / "tad" / "adapter_config.json"))
    c["modules_to_save"] = ["lm_head"]
    json.dump(c, open(tmp_path / "tad" / "adapter_config.json", "w"))
    p = qtune("export", "--model", t, "--adapter", tmp_path / "tad", "--gguf", tmp_path / "t.gguf", check=None)
    assert p.returncode != 0 and "tied embeddings" in p.stderr and "qtune merge" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "t.gguf")


def test_qwen1_tokenizer_as_output_is_refused(qwen1, tmp_path):
    """The "OUT is an input" check looked at .json and .safetensors files only, so --gguf DIR/qwen.tiktoken
    replaced the original Qwen's tokenizer with the GGUF and exited 0."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(qwen1[0], m)
    before = (m / "qwen.tiktoken").read_bytes()
    p = qtune("export", "--model", m, "--gguf", m / "qwen.tiktoken", check=2)
    assert "is an input of the export" in p.stderr and "qwen.tiktoken" in p.stderr, p.stderr
    assert (m / "qwen.tiktoken").read_bytes() == before


def test_qwen1_unk_is_endoftext_even_with_config_ids(qwen1, tmp_path):
    """_set_vocab_qwen sets unk to <|endoftext|> whatever the configs hold (bos/eos only when they hold no
    special id); qtune set unk only with no ids at all."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(qwen1[0], m)
    cfg = json.load(open(m / "config.json"))
    cfg["eos_token_id"] = 5
    json.dump(cfg, open(m / "config.json", "w"))
    qtune("export", "--model", m, "--gguf", tmp_path / "q.gguf", "--dtype", "f32")
    kv = read_gguf(tmp_path / "q.gguf").kv
    assert kv["tokenizer.ggml.unknown_token_id"] == len(qwen1[1]) and kv["tokenizer.ggml.eos_token_id"] == 5, kv
