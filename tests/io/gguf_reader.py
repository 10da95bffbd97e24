"""A GGUF (v3) reader written here from the format's specification
(ggml/docs/gguf.md), independent of qtune's writer: it checks the layout
rules as it reads (magic, version, alignment of the data section and of every
tensor, tensors inside the file and not overlapping) and returns the metadata
and every tensor as a numpy array in PyTorch's order (outermost first).

    r = read_gguf(path)
    r.kv["general.architecture"], r.types["tokenizer.ggml.tokens"]
    r.tensors["blk.0.attn_q.weight"] -> Tensor(type, ne, raw bytes, array f32)
"""
import struct
from dataclasses import dataclass

import numpy as np

# metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
          I64: "<q", F64: "<d"}
# ggml tensor types this reader knows
GGML_F32, GGML_F16, GGML_Q8_0, GGML_BF16 = 0, 1, 8, 30
TYPE_NAMES = {GGML_F32: "f32", GGML_F16: "f16", GGML_Q8_0: "q8_0", GGML_BF16: "bf16"}
QK8_0 = 32


@dataclass
class Tensor:
    type: int
    ne: tuple          # innermost first, as the file stores it
    raw: bytes
    array: np.ndarray  # f32 values, PyTorch shape (ne reversed)

    @property
    def type_name(self):
        return TYPE_NAMES[self.type]


class Reader:
    def __init__(self, buf):
        self.b, self.p = buf, 0

    def take(self, n):
        assert self.p + n <= len(self.b), f"file ends inside a field at byte {self.p}"
        s = self.b[self.p:self.p + n]
        self.p += n
        return s

    def scalar(self, t):
        fmt = SCALAR[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        n = self.scalar(U64)
        return self.take(n).decode("utf-8")

    def value(self, t):
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.scalar(U32), self.scalar(U64)
            return [self.value(et) for _ in range(n)], et
        return self.scalar(t)


def row_bytes(t, n):
    if t == GGML_F32:
        return 4 * n
    if t in (GGML_F16, GGML_BF16):
        return 2 * n
    if t == GGML_Q8_0:
        assert n % QK8_0 == 0
        return n // QK8_0 * (2 + QK8_0)
    raise AssertionError(f"unknown ggml type {t}")


def dequantize(t, raw, n):
    if t == GGML_F32:
        return np.frombuffer(raw, dtype="<f4").copy()
    if t == GGML_F16:
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if t == GGML_BF16:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if t == GGML_Q8_0:
        blk = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2 + QK8_0)
        d = blk[:, :2].copy().view("<f2").astype(np.float32)
        q = blk[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    raise AssertionError(f"unknown ggml type {t}")


@dataclass
class GGUF:
    version: int
    kv: dict
    types: dict        # key -> value type (ARRAY keys: (ARRAY, element type))
    tensors: dict
    order: list        # tensor names in file order
    alignment: int


def read_gguf(path):
    buf = open(path, "rb").read()
    r = Reader(buf)
    assert r.take(4) == b"GGUF", "bad magic"
    version = r.scalar(U32)
    assert version == 3, version
    n_t, n_kv = r.scalar(U64), r.scalar(U64)
    kv, types = {}, {}
    for _ in range(n_kv):
        k = r.string()
        assert k not in kv, f"duplicate key {k}"
        t = r.scalar(U32)
        v = r.value(t)
        if t == ARRAY:
            v, et = v
            types[k] = (ARRAY, et)
        else:
            types[k] = t
        kv[k] = v
    align = kv.get("general.alignment", 32)
    infos = []
    for _ in range(n_t):
        name = r.string()
        nd = r.scalar(U32)
        ne = tuple(r.scalar(U64) for _ in range(nd))
        t = r.scalar(U32)
        off = r.scalar(U64)
        assert off % align == 0, f"{name}: offset {off} not aligned to {align}"
        infos.append((name, ne, t, off))
    data0 = (r.p + align - 1) // align * align
    assert all(c == 0 for c in buf[r.p:data0]), "padding before the data section is not zero"
    tensors, spans = {}, []
    for name, ne, t, off in infos:
        assert name not in tensors, f"duplicate tensor {name}"
        n = int(np.prod(ne))
        nb = row_bytes(t, n)
        a, e = data0 + off, data0 + off + nb
        assert e <= len(buf), f"{name} runs past the end of the file"
        spans.append((a, e))
        raw = buf[a:e]
        arr = dequantize(t, raw, n).reshape(tuple(reversed(ne)))
        tensors[name] = Tensor(t, ne, raw, arr)
    spans.sort()
    for (a0, e0), (a1, _) in zip(spans, spans[1:]):
        assert e0 <= a1, "tensors overlap"
    return GGUF(version, kv, types, tensors, [i[0] for i in infos], align)
