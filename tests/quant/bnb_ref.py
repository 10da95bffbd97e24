"""An independent reference of bitsandbytes' 4-bit (NF4, FP4) and 8-bit
blockwise quantization, written in numpy float32 from bitsandbytes' published
algorithm (csrc/kernels.cu kQuantizeBlockwise / kDequantizeBlockwise,
dQuantizeNF4, dQuantizeFP4, dQuantize; bitsandbytes/functional.py
quantize_4bit, dequantize_4bit, quantize_blockwise, create_dynamic_map,
get_4bit_type, QuantState.as_dict). qtune's src/core/quant4.c is held against
it bit for bit (tests/quant/test_quant4_ref.py).

Every step is float32 as in the CUDA kernels: a block's absmax is max |x| over
its values; the values are multiplied by 1 / absmax (a float32 reciprocal, not
a division); the 4-bit code is chosen by the kernel's decision tree (a value
equal to a threshold takes the lower code); the first of two values goes to
the high nibble. Double quantization: offset = mean(absmax), then absmax -
offset quantized 8-bit in blocks of 256 against the signed dynamic map. The
one step not taken from torch: the mean is summed in float64 and rounded once
(torch's float32 reduction order depends on the device and the version)."""
import numpy as np

F = np.float32

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=F)
# get_4bit_type("fp4"): in bit-pattern order, divided by the largest (12) in float32
FP4 = (np.array([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0],
                dtype=F) / F(12.0)).astype(F)



def f32_literal(text):
    """A C float literal ("0.86f") as the compiler reads it: the decimal rounded once to float32. Going
    through a double first rounds twice, and the thresholds, being midpoints of float32 codes, are exactly
    where that gives the other float."""
    from fractions import Fraction
    exact = Fraction(text)
    f = np.float32(float(text))
    cands = [np.nextafter(f, F(-np.inf)), f, np.nextafter(f, F(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array([c]).view(np.uint32)[0]) & 1))
    return F(best)


# dQuantizeNF4's thresholds (float literals in the kernel), as a tree
_NF4_T = [f32_literal(t) for t in ("0.03979014977812767", "0.3893125355243683", "0.6427869200706482",
                                   "0.8614784181118011", "0.5016634166240692", "0.2035212516784668",
                                   "0.2920137718319893", "0.1202552504837513", "-0.33967943489551544",
                                   "-0.13791173323988914", "-0.045525018125772476", "-0.23460740596055984",
                                   "-0.6106329262256622", "-0.4599952697753906", "-0.8480964004993439")]
_FP4_T = [f32_literal(t) for t in ("0.29166667", "0.583333", "0.8333333", "0.4166667", "0.0859375", "0.20833333",
                                   "0.00260417")]


def nf4_code(x):
    t = _NF4_T
    if x > t[0]:
        if x > t[1]:
            if x > t[2]:
                return 15 if x > t[3] else 14
            return 13 if x > t[4] else 12
        if x > t[5]:
            return 11 if x > t[6] else 10
        return 9 if x > t[7] else 8
    if x > t[8]:
        if x > t[9]:
            return 7 if x > t[10] else 6
        return 5 if x > t[11] else 4
    if x > t[12]:
        return 3 if x > t[13] else 2
    return 1 if x > t[14] else 0


def fp4_code(x):
    sign = 8 if x < 0 else 0
    x = abs(x)
    t = _FP4_T
    if x > t[0]:
        if x > t[1]:
            return (3 if x > t[2] else 2) + sign
        return (5 if x > t[3] else 4) + sign
    if x > t[4]:
        return (7 if x > t[5] else 6) + sign
    return (1 if x > t[6] else 0) + sign


def create_dynamic_map():
    """functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) as published, in torch."""
    import torch
    data = []
    for i in range(7):
        items = int(2 ** i + 1)
        b = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32).numpy()


def q8_code(code, x):
    """dQuantize<0>: the kernel's binary search over the sorted map, then the nearer neighbour."""
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = F(-1.0), F(1.0)
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower = pivot, val
            pivot += i
        else:
            upper_pivot, upper = pivot, val
            pivot -= i
        val = code[pivot]
        i >>= 1
    if upper_pivot == 255:
        upper = code[upper_pivot]
    if lower_pivot == 0:
        lower = code[lower_pivot]
    if x > val:
        mid = F((upper + val) * F(0.5))
        return upper_pivot if x > mid else pivot
    mid = F((lower + val) * F(0.5))
    return lower_pivot if x < mid else pivot


def _blocks(x, bs):
    x = np.asarray(x, dtype=F).reshape(-1)
    for b0 in range(0, len(x), bs):
        yield b0, x[b0:b0 + bs]


def _absmax_inv(blk):
    am = F(np.max(np.abs(blk))) if len(blk) else F(0)
    with np.errstate(divide="ignore"):
        inv = F(1.0) / am
    return am, inv


def quantize_4bit(x, quant_type="nf4", blocksize=64):
    """Returns (packed uint8 of (n + 1) // 2, absmax float32 of ceil(n / blocksize))."""
    x = np.asarray(x, dtype=F).reshape(-1)
    n = len(x)
    f = nf4_code if quant_type == "nf4" else fp4_code
    codes = np.zeros(n + (n & 1), dtype=np.uint8)
    absmax = np.zeros((n + blocksize - 1) // blocksize, dtype=F)
    with np.errstate(invalid="ignore", over="ignore"):
        for b0, blk in _blocks(x, blocksize):
            am, inv = _absmax_inv(blk)
            absmax[b0 // blocksize] = am
            for j, v in enumerate(blk):
                codes[b0 + j] = f(F(v * inv))
            if b0 + len(blk) == n and n & 1:
                codes[n] = f(F(F(0) * inv))  # the kernel loads 0 past the end, and stores its nibble
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.astype(np.uint8), absmax


def dequantize_4bit(packed, absmax, code, n, blocksize=64):
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(2 * len(packed), dtype=np.uint8)
    codes[0::2] = packed >> 4
    codes[1::2] = packed & 15
    codes = codes[:n]
    am = np.repeat(np.asarray(absmax, dtype=F), blocksize)[:n]
    return (code[codes] * am).astype(F)


def quantize_blockwise(x, code, blocksize=256):
    x = np.asarray(x, dtype=F).reshape(-1)
    q = np.zeros(len(x), dtype=np.uint8)
    absmax = np.zeros((len(x) + blocksize - 1) // blocksize, dtype=F)
    with np.errstate(invalid="ignore", over="ignore"):
        for b0, blk in _blocks(x, blocksize):
            am, inv = _absmax_inv(blk)
            absmax[b0 // blocksize] = am
            for j, v in enumerate(blk):
                q[b0 + j] = q8_code(code, F(v * inv))
    return q, absmax


def dequantize_blockwise(q, absmax, code, blocksize=256):
    am = np.repeat(np.asarray(absmax, dtype=F), blocksize)[:len(q)]
    return (code[np.asarray(q)] * am).astype(F)


def absmax_offset(absmax):
    return F(np.sum(np.asarray(absmax, dtype=np.float64)) / len(absmax))


def double_quant(absmax, code8):
    """Returns (offset, quantized absmax uint8, nested_absmax float32)."""
    off = absmax_offset(absmax)
    q, am2 = quantize_blockwise((np.asarray(absmax, dtype=F) - off).astype(F), code8, 256)
    return off, q, am2


def nested_absmax(q, am2, code8, offset):
    """dequantize_4bit's absmax with a nested state: dequantize_blockwise, then += offset (float32)."""
    return (dequantize_blockwise(q, am2, code8, 256) + F(offset)).astype(F)
