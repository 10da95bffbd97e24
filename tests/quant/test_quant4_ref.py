"""core/quant4.c (NF4, FP4, double quantization) held bit for bit against
bnb_ref.py, the reference written from bitsandbytes' published algorithm."""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bnb_ref  # noqa: E402

BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
DRIVER = os.path.join(BUILD, "tests", "unit", "core", "qtune_q4_driver")
F = np.float32


def run_driver(tmp_path, x, rows, cols, qtype, nested, dtype):
    if not os.path.exists(DRIVER):
        pytest.fail("qtune_q4_driver is not built at %s; build the project first" % DRIVER)
    inp = tmp_path / "in.f32"
    np.asarray(x, dtype=F).tofile(inp)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    subprocess.run([DRIVER, str(inp), str(rows), str(cols), qtype, str(int(nested)), dtype, str(out)], check=True)
    rd = lambda name, dt: np.fromfile(out / name, dtype=dt)  # noqa: E731
    return {k: rd(k, dt) for k, dt in (("packed.bin", np.uint8), ("absmax.bin", np.uint8 if nested else F),
                                       ("dequant.f32", F), ("dequant_rows.f32", F),
                                       ("dequant_scalar.f32", F), ("dequant_avx2.f32", F), ("tables.f32", F))} | (
        {"absmax2.bin": rd("absmax2.bin", F), "offset.f32": rd("offset.f32", F)} if nested else {})


def to_dtype(x, dtype):
    import torch
    t = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    return torch.from_numpy(np.asarray(x, dtype=F)).to(t).float().numpy()


def weights(seed, n):
    """Normal values with the cases that find mistakes: blocks of zeros (absmax 0: the kernel's NaN path),
    values on the NF4 thresholds times a power of two, exact ties, tiny and huge magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(F) * F(0.02)
    x[64:128] = 0
    x[128:192] = rng.standard_normal(64).astype(F) * F(1e-30)
    x[192:256] = rng.standard_normal(64).astype(F) * F(3e3)  # within fp16
    ts = np.array(bnb_ref._NF4_T + bnb_ref._FP4_T, dtype=F)
    x[256:256 + len(ts)] = ts
    x[256 + len(ts)] = 1.0  # the block's absmax is 1: the thresholds arrive exactly
    x[320:320 + len(ts)] = -ts
    x[320 + len(ts)] = -1.0
    return x


def check(tmp_path, rows, cols, qtype, nested, dtype, seed=0):
    x = to_dtype(weights(seed, rows * cols), dtype)
    got = run_driver(tmp_path, x, rows, cols, qtype, nested, dtype)
    packed, absmax = bnb_ref.quantize_4bit(x, qtype, 64)
    code4 = bnb_ref.NF4 if qtype == "nf4" else bnb_ref.FP4
    assert np.array_equal(got["packed.bin"], packed), "packed codes differ"
    if nested:
        code8 = bnb_ref.create_dynamic_map()
        off, q, am2 = bnb_ref.double_quant(absmax, code8)
        assert got["offset.f32"].view(np.uint32)[0] == np.array([off], dtype=F).view(np.uint32)[0]
        assert np.array_equal(got["absmax.bin"], q), "nested absmax codes differ"
        assert np.array_equal(got["absmax2.bin"].view(np.uint32), am2.view(np.uint32))
        absmax = bnb_ref.nested_absmax(q, am2, code8, off)
    else:
        assert np.array_equal(got["absmax.bin"].view(np.uint32), absmax.view(np.uint32))
    want = to_dtype(bnb_ref.dequantize_4bit(packed, absmax, code4, rows * cols, 64), dtype)
    assert np.array_equal(got["dequant.f32"].view(np.uint32), want.view(np.uint32)), "dequantized values differ"
    for k in ("dequant_rows.f32", "dequant_scalar.f32", "dequant_avx2.f32"):
        assert np.array_equal(got[k].view(np.uint32), want.view(np.uint32)), k
    view = np.fromfile(tmp_path / "out" / "dequant_view.f32", dtype=F)
    assert np.array_equal(view.view(np.uint32), want[cols:].view(np.uint32)), "a row view differs"
    return x, want


@pytest.mark.parametrize("qtype", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_quantize_dequantize_bit_exact(tmp_path, qtype, nested, dtype):
    # 97 x 96: 9312 values, 145.5 blocks of 64 (a partial last block), 146 absmax values (a partial nested block)
    check(tmp_path, 97, 96, qtype, nested, dtype)


def test_odd_count_pads_the_last_nibble(tmp_path):
    # 3 x 141 = 423 values: a partial last block and an odd count (the kernel quantizes a 0 into the last
    # low nibble)
    check(tmp_path, 3, 141, "nf4", True, "bf16", seed=1)


def test_tables(tmp_path):
    got = run_driver(tmp_path, np.ones(64, dtype=F), 1, 64, "nf4", True, "f32")["tables.f32"]
    assert np.array_equal(got[:16].view(np.uint32), bnb_ref.NF4.view(np.uint32))
    assert np.array_equal(got[16:32].view(np.uint32), bnb_ref.FP4.view(np.uint32))
    assert np.array_equal(got[32:].view(np.uint32), bnb_ref.create_dynamic_map().view(np.uint32))
    # the kernel's FP4 dequantization table is the same floats as get_4bit_type("fp4")
    lut = np.array([0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25], dtype=F)
    assert np.array_equal(lut, bnb_ref.FP4[:8])


def test_nf4_error_is_small(tmp_path):
    """Not bit-exactness but sense: NF4 of normal weights keeps the weights within ~10% RMS."""
    x, deq = check(tmp_path, 64, 128, "nf4", False, "f32", seed=3)
    keep = np.ones(len(x), bool)
    keep[64:400] = False
    err = np.sqrt(np.mean((deq[keep] - x[keep]) ** 2)) / np.sqrt(np.mean(x[keep] ** 2))
    assert err < 0.12, err
