"""A tiny safetensors reader/writer on struct + json + numpy (torch 1.13 has no
safetensors). Layout: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [a, b]}, "__metadata__": {...}},
then the data; offsets are relative to the end of the header."""
import json
import struct

import numpy as np

_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even, as torch does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def read(path):
    """Returns {name: float32/float64/int numpy array} (BF16 and F16 widened to F32)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[base + a:base + b]
        dt = info["dtype"]
        if dt == "BF16":
            arr = bf16_to_f32(np.frombuffer(raw, dtype=np.uint16))
        else:
            arr = np.frombuffer(raw, dtype=_NP[dt]).astype(np.float32 if dt == "F16" else _NP[dt])
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def read_dtypes(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def write(path, tensors, dtype="F32", metadata=None):
    """tensors: {name: numpy array}; stored as dtype (F32, F16, BF16)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        x = np.asarray(tensors[name])
        if dtype == "BF16":
            raw = f32_to_bf16(x).tobytes()
        elif dtype == "F16":
            raw = x.astype(np.float16).tobytes()
        else:
            raw = x.astype(np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)  # keep the data 8-byte aligned, as HF does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
