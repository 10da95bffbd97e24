"""A fixture generator: a model folder as transformers saves one loaded with
BitsAndBytesConfig(load_in_4bit=True) (unsloth's "-bnb-4bit" folders), from a
16-bit folder, by bnb_ref's quantizer. Layout from bitsandbytes' published
source (Linear4bit._save_to_state_dict writes QuantState.as_dict(packed=True)
beside the weight): for each quantized Linear NAME.weight

  NAME.weight                                   U8 [(n + 1) / 2, 1]  packed codes
  NAME.weight.absmax                            F32 [nb], or U8 [nb] with double quantization
  NAME.weight.quant_map                         F32 [16]
  NAME.weight.nested_absmax                     F32 [ceil(nb / 256)]   (double quantization)
  NAME.weight.nested_quant_map                  F32 [256]              (double quantization)
  NAME.weight.quant_state.bitsandbytes__nf4     U8: JSON {quant_type, blocksize, dtype, shape
                                                (+ nested_blocksize, nested_dtype, nested_offset)}

and config.json's quantization_config names quant_method bitsandbytes. The
decoder layers' linears are quantized; embeddings, lm_head and norms stay as
they were, as transformers keeps them."""
import json
import os
import shutil
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ref"))
import bnb_ref  # noqa: E402
import st  # noqa: E402

TORCH_NAME = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def write_mixed(path, tensors):
    """tensors: {name: (safetensors dtype, numpy array)}; U8 as bytes, F32/F16/BF16 from float values."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, x = tensors[name]
        x = np.asarray(x)
        if dt == "U8":
            raw = x.astype(np.uint8).tobytes()
        elif dt == "BF16":
            raw = st.f32_to_bf16(x).tobytes()
        elif dt == "F16":
            raw = x.astype(np.float16).tobytes()
        else:
            raw = x.astype(np.float32).tobytes()
        header[name] = {"dtype": dt, "shape": list(x.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def is_layer_linear(name, x):
    return x.ndim == 2 and (".layers." in name or name.startswith("transformer.h.")) and name.endswith(".weight")


def bnb_folder(src, dst, qtype="nf4", nested=True):
    """Writes dst, the 4-bit folder of the 16-bit folder src; returns dst."""
    shutil.copytree(src, dst)
    path = os.path.join(src, "model.safetensors")
    w, dts = st.read(path), st.read_dtypes(path)
    code4 = bnb_ref.NF4 if qtype == "nf4" else bnb_ref.FP4
    code8 = bnb_ref.create_dynamic_map()
    out = {}
    for k, v in w.items():
        if not is_layer_linear(k, v):
            out[k] = (dts[k], v)
            continue
        packed, absmax = bnb_ref.quantize_4bit(v.reshape(-1), qtype, 64)
        out[k] = ("U8", packed.reshape(-1, 1))
        out[k + ".quant_map"] = ("F32", code4)
        state = {"quant_type": qtype, "blocksize": 64, "dtype": TORCH_NAME[dts[k]], "shape": list(v.shape)}
        if nested:
            off, q, am2 = bnb_ref.double_quant(absmax, code8)
            out[k + ".absmax"] = ("U8", q)
            out[k + ".nested_absmax"] = ("F32", am2)
            out[k + ".nested_quant_map"] = ("F32", code8)
            state.update({"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(off)})
        else:
            out[k + ".absmax"] = ("F32", absmax)
        out[k + ".quant_state.bitsandbytes__" + qtype] = ("U8", np.frombuffer(json.dumps(state).encode(), np.uint8))
    write_mixed(os.path.join(dst, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                                  "bnb_4bit_quant_type": qtype, "bnb_4bit_use_double_quant": nested,
                                  "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
                                  "llm_int8_skip_modules": None}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def read_mixed(path):
    """{name: (dtype, raw numpy array)} with U8 kept as bytes (for tests that make a folder lie)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[base + a:base + b]
        dt = info["dtype"]
        if dt == "U8":
            arr = np.frombuffer(raw, dtype=np.uint8)
        elif dt == "BF16":
            arr = st.bf16_to_f32(np.frombuffer(raw, dtype=np.uint16))
        else:
            arr = np.frombuffer(raw, dtype=np.float16 if dt == "F16" else np.float32).astype(np.float32)
        out[name] = (dt, arr.reshape(info["shape"]).copy())
    return out
