"""Gradients of one forward/backward in f16 and bf16 compute against the same
model in f32 (which tests/ref holds to torch float64 within 1e-4), through
tests/ref's qtune_ref_driver with --compute. Measured worst relative errors
per tensor (||g - g32|| / ||g32||) on these shapes: f16 2.8e-3, bf16 2.25e-2
(docs/precision.md); the bounds below leave about 3x / 2x margin. bf16 runs
emulated (QTUNE_BF16_EMULATE=1: bf16 values through fp32 sgemm) on every CPU,
and natively (oneDNN bf16 GEMMs) where the CPU has AVX512_BF16."""
import numpy as np
import pytest

from conftest import EMULATE, driver, ref

TOL = {"f16": 1e-2, "bf16": 5e-2}
LORA = ["--lora", "8", "16", "q_proj,v_proj,down_proj"]


HAS_BF16 = "avx512_bf16" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("compute", ["f16", "bf16", "bf16-native"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("shape", ["qwen2-gqa1-d64-tied-f32", "qwen2-gqa2-d64-untied-bf16",
                                   "qwen3-gqa4-d64-untied-bf16"])
def test_grads_match_fp32(tmp_path, shape, mode, compute):
    env = EMULATE
    if compute == "bf16-native":
        if not HAS_BF16:
            pytest.skip("this CPU has no AVX512_BF16: bf16 only runs emulated")
        compute, env = "bf16", {"QTUNE_BF16_EMULATE": "0"}
    md = str(tmp_path / "model")
    cfg = ref.make_model(md, shape)
    batch = ref.make_batch(cfg["vocab_size"])
    opts = ["--mode", "train", "--grad-scale", "0.01"] + (LORA if mode == "lora" else [])
    want = driver(str(tmp_path), md, batch, *opts, tag="f32")
    got = driver(str(tmp_path), md, batch, *opts, "--compute", compute, tag=compute, env=env)
    names = [k for k in want if k.startswith("grad/")]
    assert names and set(names) == {k for k in got if k.startswith("grad/")}
    worst = max((ref.rel_err(got[k], want[k]), k) for k in names)
    assert worst[0] <= TOL[compute], "%s gradient %s rel err %.3g" % (compute, worst[1], worst[0])
    # the reduced precision is really in effect: not bit-identical to f32
    assert worst[0] > 1e-6
    assert abs(got["loss_sum"][0] - want["loss_sum"][0]) <= TOL[compute] * abs(want["loss_sum"][0])


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fp16_overflows_to_inf_where_fp32_does_not(tmp_path, mode):
    """A loss scale of 2^40 overflows fp16's 65504 in the stored activation
    gradients: the gradients come out non-finite (what the loss scaler looks
    for), while the same scale in f32 stays finite."""
    md = str(tmp_path / "model")
    cfg = ref.make_model(md, "qwen2-gqa1-d64-tied-f32")
    batch = ref.make_batch(cfg["vocab_size"])
    n = sum(t != -100 for t in batch["targets"])
    opts = ["--mode", "train", "--grad-scale", repr(2.0 ** 40 / n)] + (LORA if mode == "lora" else [])
    f32 = driver(str(tmp_path), md, batch, *opts, tag="f32")
    f16 = driver(str(tmp_path), md, batch, *opts, "--compute", "f16", tag="f16")
    grads = [k for k in f32 if k.startswith("grad/")]
    assert all(np.isfinite(f32[k]).all() for k in grads)
    assert not all(np.isfinite(f16[k]).all() for k in grads)
    # the forward is unaffected: the loss is finite either way
    assert np.isfinite(f16["loss_sum"][0])
