"""merge and export --gguf of an adapter trained on a bitsandbytes 4-bit base (QLoRA). Without --base16 the
adapter goes into the folder's dequantized weights: W' = dequantize_4bit(W) + B A * scaling in float32, written
in the dtype the 4-bit values dequantize to, held here against tests/quant/bnb_ref.py's dequantization (a
reference written from bitsandbytes' published algorithm) and against qtune eval of the 4-bit base with the
adapter. With --base16 DIR it goes into the 16-bit folder the 4-bit one was made from (checked first: a folder
of other values or shapes is refused in one sentence), exactly as a merge into that folder."""
import json
import os
import sys

import numpy as np
import pytest

from trainutil import init_model, run, st, write_job, write_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "quant"))
sys.path.insert(0, os.path.join(HERE, "..", "io"))
import bnb_folder  # noqa: E402
import bnb_ref  # noqa: E402
from gguf_reader import read_gguf  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


TINY_TOK = os.path.join(HERE, "..", "..", "fuzz", "corpus", "tokenizer", "tiny.json")


def make_base(d, qtype="nf4", nested=True, preset="tiny", lora=LORA):
    """A bf16 model (with a tokenizer, for GGUF), its 4-bit folder and an adapter trained 3 steps on the 4-bit one."""
    model = os.path.join(d, "model")
    run("init", "--out", model, "--preset", preset, "--seed", 3, "--dtype", "bf16", "--tokenizer", TINY_TOK)
    bnb = bnb_folder.bnb_folder(model, os.path.join(d, "bnb"), qtype, nested)
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    job = write_job(os.path.join(d, "job.json"), bnb, os.path.join(d, "out"), os.path.join(d, "train.jsonl"),
                    lora=lora, train_opts={"max_steps": 3, "learning_rate": 1e-2})
    run("train", job)
    return model, bnb, os.path.join(d, "out", "final")


def expected_merge(bnb, ad, lora=LORA):
    """The reference: each 4-bit weight dequantized by bnb_ref, B A * scaling added in float32, rounded to bf16."""
    t = bnb_folder.read_mixed(os.path.join(bnb, "model.safetensors"))
    a = st.read(os.path.join(ad, "adapter_model.safetensors"))
    scaling = np.float32(lora["lora_alpha"] / lora["r"])
    out = {}
    for k, (dt, v) in t.items():
        if bnb4_part(k):
            continue
        qs = [n for n in t if n.startswith(k + ".quant_state.")]
        if not qs:
            out[k] = v
            continue
        state = json.loads(bytes(t[qs[0]][1]).decode())
        n = int(np.prod(state["shape"]))
        code = t[k + ".quant_map"][1]
        absmax = t[k + ".absmax"][1]
        if "nested_offset" in state:
            absmax = bnb_ref.nested_absmax(absmax, t[k + ".nested_absmax"][1], t[k + ".nested_quant_map"][1],
                                           state["nested_offset"])
        w = bnb_ref.dequantize_4bit(t[k][1].reshape(-1), absmax, code, n, state["blocksize"])
        w = st.bf16_to_f32(st.f32_to_bf16(w)).reshape(state["shape"])  # dequantize_4bit returns quant_state.dtype
        la, lb = "base_model.model." + k[:-7] + ".lora_A.weight", "base_model.model." + k[:-7] + ".lora_B.weight"
        if la in a:
            out["adapted"] = out.get("adapted", 0) + 1
            w = (w.astype(np.float32) + (a[lb].astype(np.float32) @ a[la].astype(np.float32)) * scaling).astype(np.float32)
        out[k] = st.bf16_to_f32(st.f32_to_bf16(w))
    return out


def bnb4_part(k):
    return any(k.endswith(s) for s in (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")) or \
        ".quant_state." in k


QWEN1_LORA = dict(LORA, target_modules=["c_attn", "w2"])


@pytest.mark.parametrize("qtype,nested,preset", [("nf4", True, "tiny"), ("fp4", False, "tiny"),
                                                 ("nf4", True, "tiny-qwen3"), ("fp4", True, "tiny-qwen")])
def test_merge_into_the_dequantized_weights(tmp_path, qtype, nested, preset):
    d = str(tmp_path)
    lora = QWEN1_LORA if preset == "tiny-qwen" else LORA
    model, bnb, ad = make_base(d, qtype, nested, preset, lora)
    merged = os.path.join(d, "merged")
    p = run("merge", "--model", bnb, "--adapter", ad, "--out", merged)
    assert "merged into the dequantized 4-bit weights of" in p.stderr and "--base16" in p.stderr, p.stderr
    got = st.read(os.path.join(merged, "model.safetensors"))
    dts = st.read_dtypes(os.path.join(merged, "model.safetensors"))
    want = expected_merge(bnb, ad, lora)
    assert want.pop("adapted") == 2 * len(lora["target_modules"])  # the reference added every LoRA
    assert set(got) == set(want)
    worst = 0.0
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert dts[k] == "BF16", (k, dts[k])
        # float32 sums in another order: at most one bf16 step apart, and nearly always equal
        diff = np.abs(got[k].astype(np.float64) - want[k])
        ulp = np.abs(want[k].astype(np.float64)) * 2.0 ** -7 + 1e-30
        assert (diff <= ulp).all(), k
        worst = max(worst, float(np.mean(diff > 0)))
    assert worst < 0.01
    adapted = [k for k in want if "q_proj.weight" in k or "c_attn.weight" in k]
    base16 = st.read(os.path.join(model, "model.safetensors"))
    assert not np.array_equal(got[adapted[0]], base16[adapted[0]])  # the dequantized, not the original, weights
    cfg = json.load(open(os.path.join(merged, "config.json")))
    assert "quantization_config" not in cfg and cfg.get("torch_dtype") == "bfloat16"
    # the merged folder is the 4-bit base with the adapter: eval agrees up to the merged weights' bf16 rounding
    data = os.path.join(d, "train.jsonl")
    e1 = json.loads(run("eval", "--model", bnb, "--adapter", ad, "--data", data, "--seq-len", 16).stdout
                    .strip().splitlines()[-1])["loss"]
    e2 = json.loads(run("eval", "--model", merged, "--data", data, "--seq-len", 16).stdout
                    .strip().splitlines()[-1])["loss"]
    assert abs(e1 - e2) < 2e-3 * abs(e1), (e1, e2)


def test_merge_into_the_16bit_origin(tmp_path):
    d = str(tmp_path)
    model, bnb, ad = make_base(d)
    a, b = os.path.join(d, "m16"), os.path.join(d, "mb16")
    run("merge", "--model", model, "--adapter", ad, "--out", a)
    p = run("merge", "--model", bnb, "--base16", model, "--adapter", ad, "--out", b)
    assert "merged into the original 16-bit weights of" in p.stderr and "% of their norm" in p.stderr, p.stderr
    assert open(os.path.join(a, "model.safetensors"), "rb").read() == open(os.path.join(b, "model.safetensors"),
                                                                          "rb").read()


def test_a_wrong_base16_is_refused(tmp_path):
    d = str(tmp_path)
    model, bnb, ad = make_base(d)
    other = init_model(os.path.join(d, "other"), "tiny", seed=11, dtype="bf16")     # the same shapes, other values
    wide = init_model(os.path.join(d, "wide"), "tiny-qwen3", dtype="bf16")          # other shapes
    # the same model but for one 4-bit weight: only its codes tell
    near = init_model(os.path.join(d, "near"), "tiny", dtype="bf16")
    w = st.read(os.path.join(near, "model.safetensors"))
    k = "model.layers.1.mlp.up_proj.weight"
    w[k] = w[k] + np.random.default_rng(0).normal(0, 0.02, w[k].shape).astype(np.float32)
    st.write(os.path.join(near, "model.safetensors"), w, dtype="BF16")
    out = os.path.join(d, "merged")
    cases = [(near, "up_proj.weight quantizes (nf4, blocks of 64) to codes that differ from"),
             (other, "model.embed_tokens.weight holds other values than"),
             (wide, "is not the 16-bit folder"),
             (os.path.join(d, "missing"), "does not exist")]
    for base16, msg in cases:
        p = run("merge", "--model", bnb, "--base16", base16, "--adapter", ad, "--out", out, check=False)
        assert p.returncode != 0 and msg in p.stderr, p.stderr
        assert len([l for l in p.stderr.strip().splitlines() if "error" in l.lower()]) <= 1, p.stderr
        assert not os.path.exists(out)
    p = run("merge", "--model", model, "--base16", model, "--adapter", ad, "--out", out, check=False)
    assert p.returncode != 0 and "is no 4-bit folder" in p.stderr, p.stderr
    assert not os.path.exists(out)
    # the adapter into another model's 4-bit folder: the 4-bit shapes (from the quant_state) do not fit
    wide_bnb = bnb_folder.bnb_folder(wide, os.path.join(d, "wide-bnb"))
    for args in (["merge", "--model", wide_bnb, "--adapter", ad, "--out", out],
                 ["export", "--model", wide_bnb, "--adapter", ad, "--gguf", out + ".gguf"]):
        p = run(*args, check=False)
        assert p.returncode != 0 and "which do not fit the weight" in p.stderr, p.stderr
        assert not os.path.exists(out) and not os.path.exists(out + ".gguf")


def test_export_gguf_of_a_4bit_base(tmp_path):
    d = str(tmp_path)
    model, bnb, ad = make_base(d)
    merged = os.path.join(d, "merged")
    run("merge", "--model", bnb, "--adapter", ad, "--out", merged)
    a, b = os.path.join(d, "bnb.gguf"), os.path.join(d, "merged.gguf")
    p = run("export", "--model", bnb, "--adapter", ad, "--gguf", a, "--dtype", "f32")
    assert "written dequantized, with the adapter merged in" in p.stderr, p.stderr
    run("export", "--model", merged, "--gguf", b, "--dtype", "f32")
    ga, gb = read_gguf(a), read_gguf(b)
    assert set(ga.tensors) == set(gb.tensors)
    for k in gb.tensors:
        # merge rounds the sum to bf16, --dtype f32 keeps it: the two agree to bf16's precision
        np.testing.assert_allclose(ga.tensors[k].array, gb.tensors[k].array, rtol=2 ** -7, atol=1e-6, err_msg=k)
    run("export", "--model", bnb, "--adapter", ad, "--gguf", os.path.join(d, "q8.gguf"), "--dtype", "q8_0")
    assert read_gguf(os.path.join(d, "q8.gguf")).tensors["blk.0.attn_q.weight"].type == 8
    # no adapter: the dequantized base alone; the LoRA GGUF as from the 16-bit folder
    run("export", "--model", bnb, "--gguf", os.path.join(d, "base.gguf"))
    run("export", "--model", bnb, "--adapter", ad, "--gguf-lora", os.path.join(d, "l4.gguf"))
    run("export", "--model", model, "--adapter", ad, "--gguf-lora", os.path.join(d, "l16.gguf"))
    assert open(os.path.join(d, "l4.gguf"), "rb").read() == open(os.path.join(d, "l16.gguf"), "rb").read()
