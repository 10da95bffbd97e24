"""The hostile-input battery (docs/robustness.md): truncated, oversized,
overflowing, deeply nested, mis-typed and malicious inputs to every reader the
CLI has. Each must end in exit 1 or 2 with one clear sentence on stderr naming
the file/field, no signal, no sanitizer report and bounded memory."""
import json
import os
import re
import shutil
import struct

import pytest

from hostile_util import QTUNE, expect_error, ok, run, st_bytes, write, write_job, write_tokens  # noqa: F401

NEST = 100_000  # levels of '[' in the deep-nesting cases


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    write_tokens(d / "tokens.jsonl")
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "..", "fuzz", "corpus", "tokenizer", "tiny.json"),
                d / "tiny-tokenizer.json")
    return d


def model_copy(base, name, drop=()):
    """A copy of the tiny model folder to break."""
    dst = base / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base / "model", dst)
    for f in drop:
        os.remove(dst / f)
    return dst


def eval_args(model, base, *extra):
    return ["eval", "--model", model, "--data", base / "tokens.jsonl", "--seq-len", "8"] + list(extra)


# ---------------------------------------------------------------------------
# safetensors: lengths and offsets that overflow, truncation, bad headers

def good_tensor_header(n=4):
    return {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}


ST_CASES = {
    "empty_file": b"",
    "short_length": b"\x10\x00\x00",
    "header_len_2^63": struct.pack("<Q", 1 << 63) + b"{}",
    "header_len_2^64-1": struct.pack("<Q", (1 << 64) - 1) + b"{}",
    "header_len_past_eof": st_bytes(good_tensor_header(), b"\0" * 16, header_len=10_000),
    "header_not_json": st_bytes(b"{not json" + b" " * 8),
    "header_not_object": st_bytes(b"[1, 2, 3]"),
    "header_deep_nesting": st_bytes(b"[" * NEST + b"]" * NEST),
    "offsets_near_2^64": st_bytes({"w": {"dtype": "F32", "shape": [4],
                                         "data_offsets": [(1 << 64) - 8, (1 << 64) - 1]}}, b"\0" * 16),
    "offsets_2^63": st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [1 << 63, (1 << 63) + 8]}}, b"\0" * 8),
    "offsets_reversed": st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
    "offsets_past_eof": st_bytes(good_tensor_header(1024), b"\0" * 16),
    "offsets_negative": st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"\0" * 8),
    "offsets_float": st_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8.5]}}, b"\0" * 9),
    "shape_product_overflows": st_bytes({"w": {"dtype": "F32", "shape": [1 << 32, 1 << 32, 16],
                                               "data_offsets": [0, 16]}}, b"\0" * 16),
    "shape_negative": st_bytes({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16),
    "shape_len_mismatch": st_bytes({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16),
    "dtype_unknown": st_bytes({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
    "dtype_not_string": st_bytes({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "overlapping_tensors": st_bytes({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                     "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24),
    "many_dims": st_bytes({"w": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}, b"\0" * 4),
    "truncated_real_weights": None,  # filled in the test: the tiny model's file cut in half
}


@pytest.mark.parametrize("case", sorted(ST_CASES))
def test_bad_safetensors(base, case):
    m = model_copy(base, "st_" + case)
    data = ST_CASES[case]
    if data is None:
        full = open(base / "model" / "model.safetensors", "rb").read()
        data = full[:len(full) // 2]
    write(m / "model.safetensors", data)
    expect_error(eval_args(m, base), "model.safetensors")


def test_safetensors_missing_tensor_and_wrong_shape(base):
    import st
    w = st.read(str(base / "model" / "model.safetensors"))
    m = model_copy(base, "st_missing")
    name = sorted(k for k in w if "q_proj.weight" in k)[0]
    w2 = dict(w)
    del w2[name]
    st.write(str(m / "model.safetensors"), w2)
    expect_error(eval_args(m, base), name)
    w2 = dict(w)
    w2[name] = w[name][:, :-1].copy()
    st.write(str(m / "model.safetensors"), w2)
    expect_error(eval_args(m, base), name)


SHARD_ESCAPES = ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "..", ""]


@pytest.mark.parametrize("shard", SHARD_ESCAPES)
def test_sharded_index_outside_the_model_folder_is_refused(base, shard):
    m = model_copy(base, "shard%d" % SHARD_ESCAPES.index(shard), drop=["model.safetensors"])
    # the file the index points at exists and is a valid safetensors file: only the path is wrong
    shutil.copy(base / "model" / "model.safetensors", m.parent / "outside.safetensors")
    import st
    names = list(st.read(str(base / "model" / "model.safetensors")))
    write(m / "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": {k: shard for k in names}}))
    expect_error(eval_args(m, base), "index")


INDEX_CASES = {
    "not_json": "{\"weight_map\": ",
    "deep": "[" * NEST + "]" * NEST,
    "weight_map_not_object": json.dumps({"weight_map": [1, 2]}),
    "shard_not_string": json.dumps({"weight_map": {"a": 5}}),
    "missing_shard": json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}),
    "empty": json.dumps({"weight_map": {}}),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_sharded_index(base, case):
    m = model_copy(base, "index_" + case, drop=["model.safetensors"])
    write(m / "model.safetensors.index.json", INDEX_CASES[case])
    expect_error(eval_args(m, base), "safetensors")


def test_oversized_index_is_refused_without_reading(base):
    m = model_copy(base, "index_huge", drop=["model.safetensors"])
    with open(m / "model.safetensors.index.json", "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB of NULs
    expect_error(eval_args(m, base), "index")


# ---------------------------------------------------------------------------
# config.json

CONFIG_CASES = {
    "empty": "",
    "truncated": None,
    "not_object": "[]",
    "deep": "[" * NEST + "]" * NEST,
    "deep_object": "{\"a\":" * NEST + "1" + "}" * NEST,
    "hidden_string": {"hidden_size": "64"},
    "hidden_negative": {"hidden_size": -64},
    "hidden_huge": {"hidden_size": 1 << 40},
    "heads_zero": {"num_attention_heads": 0},
    "heads_not_dividing": {"num_attention_heads": 5},
    "kv_heads_not_dividing": {"num_key_value_heads": 3},
    "layers_float": {"num_hidden_layers": 2.5},
    "vocab_huge": {"vocab_size": 1 << 62},
    "vocab_null": {"vocab_size": None},
    "rope_theta_nan_text": "NaN",
    "eps_negative": {"rms_norm_eps": -1},
    "max_pos_zero": {"max_position_embeddings": 0},
    "unknown_arch": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_json(base, case):
    m = model_copy(base, "cfg_" + case)
    good = (base / "model" / "config.json").read_text()
    c = CONFIG_CASES[case]
    if c is None:
        text = good[:len(good) // 2]
    elif isinstance(c, dict):
        d = json.loads(good)
        d.update(c)
        text = json.dumps(d)
    elif c == "NaN":
        d = json.loads(good)
        text = json.dumps(d).replace('"rope_theta": %s' % json.dumps(d["rope_theta"]), '"rope_theta": NaN')
    else:
        text = c
    write(m / "config.json", text)
    expect_error(eval_args(m, base), "config.json")


def test_oversized_config_is_refused_without_reading(base):
    m = model_copy(base, "cfg_huge")
    with open(m / "config.json", "wb") as f:
        f.truncate(5 << 30)
    expect_error(eval_args(m, base), "config.json")


# ---------------------------------------------------------------------------
# tokenizer.json

def tok_json(base):
    return json.loads((base / "tiny-tokenizer.json").read_text())


def tok_case(base, case):
    t = tok_json(base)
    v = t["model"]["vocab"]
    if case == "duplicate_vocab_ids":
        v["Ġzz"] = v["Ġt"]  # two strings, one id
    elif case == "added_token_bad_id":
        t["added_tokens"][0]["id"] = -3
    elif case == "added_token_huge_id":
        t["added_tokens"][0]["id"] = 1 << 40
    elif case == "vocab_id_huge":
        v["Ġzz"] = 1 << 31
    elif case == "vocab_id_string":
        v["Ġzz"] = "7"
    elif case == "vocab_too_small":
        t["model"]["vocab"] = {k: i for i, k in enumerate(list(v)[:10])}
    elif case == "merge_unknown_token":
        t["model"]["merges"].append("q\u00e9\u00e9 zz")
    elif case == "merge_one_part":
        t["model"]["merges"].append("Ġt")
    elif case == "merges_not_array":
        t["model"]["merges"] = "Ġ t"
    elif case == "model_not_bpe":
        t["model"]["type"] = "WordPiece"
    elif case == "no_model":
        del t["model"]
    elif case == "bad_regex":
        t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?<bad"
    elif case == "normalizer_unsupported":
        t["normalizer"] = {"type": "NFKD"}
    elif case == "added_tokens_not_array":
        t["added_tokens"] = {"a": 1}
    elif case == "ignore_merges_not_bool":  # read as a flag (a word in the vocabulary skips the merges)
        t["model"]["ignore_merges"] = "yes"
    elif case == "bpe_dropout":  # HF: merges skipped at random; it was ignored
        t["model"]["dropout"] = 0.1
    else:
        raise KeyError(case)
    return json.dumps(t)


TOK_CASES = ["duplicate_vocab_ids", "added_token_bad_id", "added_token_huge_id", "vocab_id_huge", "vocab_id_string",
             "vocab_too_small", "merge_unknown_token", "merge_one_part", "merges_not_array", "model_not_bpe",
             "no_model", "bad_regex", "normalizer_unsupported", "added_tokens_not_array", "ignore_merges_not_bool", "bpe_dropout"]


@pytest.mark.parametrize("case", TOK_CASES)
def test_bad_tokenizer_json(base, case):
    p = write(base / ("tok_%s.json" % case), tok_case(base, case))
    expect_error(["tokenize", "--tokenizer", p, "--text", "the cat"], "tok_%s.json" % case)


RAW_TOK_CASES = {
    "empty": b"",
    "truncated": None,
    "deep": b"[" * NEST + b"]" * NEST,
    "deep_in_vocab": b'{"model": {"type": "BPE", "vocab": ' + b"[" * NEST + b"]" * NEST + b', "merges": []}}',
    "binary": bytes(range(256)) * 4,
}


@pytest.mark.parametrize("case", sorted(RAW_TOK_CASES))
def test_unreadable_tokenizer_json(base, case):
    data = RAW_TOK_CASES[case]
    if data is None:
        full = (base / "tiny-tokenizer.json").read_bytes()
        data = full[:len(full) * 2 // 3]
    p = write(base / ("tokraw_%s.json" % case), data)
    expect_error(["tokenize", "--tokenizer", p, "--text", "the cat"], "tokraw_%s.json" % case)


def test_invalid_utf8_tokenizer_input_is_replaced_not_fatal(base):
    """Invalid UTF-8 given to the tokenizer is not an error: it becomes U+FFFD
    (HF's behaviour after Python's decode(errors="replace")), so the ids equal
    those of the replaced text."""
    bad = b"ab\xff\xfe c\xc3\x28 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 end"
    write(base / "bad_utf8.txt", bad)
    write(base / "replaced.txt", bad.decode("utf-8", "replace").encode())
    tk = base / "tiny-tokenizer.json"
    a = ok(["tokenize", "--tokenizer", tk, "--file", base / "bad_utf8.txt", "--json"])
    b = ok(["tokenize", "--tokenizer", tk, "--file", base / "replaced.txt", "--json"])
    assert json.loads(a.stdout)["ids"] == json.loads(b.stdout)["ids"]


def test_decode_out_of_range_ids(base):
    tk = base / "tiny-tokenizer.json"
    expect_error(["tokenize", "--tokenizer", tk, "--decode", "1,2,99999999"], "99999999")
    expect_error(["tokenize", "--tokenizer", tk, "--decode", "1,-5"], "-5")
    expect_error(["tokenize", "--tokenizer", tk, "--decode", "1,99999999999999999999999"])
    expect_error(["tokenize", "--tokenizer", tk, "--decode", "1,x"])


def test_oversized_tokenizer_is_refused_without_reading(base):
    p = base / "huge-tokenizer.json"
    with open(p, "wb") as f:
        f.truncate(3 << 30)
    expect_error(["tokenize", "--tokenizer", p, "--text", "a"], "huge-tokenizer.json")


# ---------------------------------------------------------------------------
# JSONL datasets (eval reads them through the same data module as train)

JSONL_CASES = {
    "empty_file": b"",
    "only_blank_lines": b"\n\n\n",
    "not_json": b"this is not json\n",
    "deep_line": b"[" * NEST + b"]" * NEST + b"\n",
    "deep_object_line": b"{\"a\":" * NEST + b"1" + b"}" * NEST + b"\n",
    "top_level_array": b"[1, 2, 3]\n",
    "unknown_keys": b'{"foo": "bar"}\n',
    "text_not_string": b'{"text": 5}\n',
    "ids_not_ints": b'{"input_ids": [1, "two", 3]}\n',
    "ids_float": b'{"input_ids": [1, 2.5, 3]}\n',
    "ids_negative": b'{"input_ids": [1, -2, 3]}\n',
    "ids_out_of_vocab": b'{"input_ids": [1, 2, 1000000]}\n',
    "ids_2^63": b'{"input_ids": [1, 9223372036854775808, 3]}\n',
    "labels_length_differs": b'{"input_ids": [1, 2, 3], "labels": [1, 2]}\n',
    "empty_ids": b'{"input_ids": []}\n',
    "messages_not_array": b'{"messages": "hi"}\n',
    "message_bad_role": b'{"messages": [{"role": "robot", "content": "x"}]}\n',
    "message_content_not_string": b'{"messages": [{"role": "user", "content": 5}]}\n',
    "truncated_line": b'{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5',
    "nul_bytes": b'{"input_ids": [1, 2]}\n\0\0\0\0\n',
}


@pytest.mark.parametrize("case", sorted(JSONL_CASES))
def test_bad_jsonl(base, case):
    p = write(base / ("bad_%s.jsonl" % case), JSONL_CASES[case])
    expect_error(["eval", "--model", base / "model", "--data", p, "--seq-len", "8"], "bad_%s.jsonl" % case)


def test_invalid_utf8_in_jsonl_text(base):
    """Invalid UTF-8 inside a JSON string of a text/chat dataset: refused with
    the file and line, or read with U+FFFD; never a crash."""
    m = model_copy(base, "tok_model")
    shutil.copy(base / "tiny-tokenizer.json", m / "tokenizer.json")
    p = write(base / "bad_utf8.jsonl", b'{"text": "good line"}\n{"text": "bad \xff\xfe\xc3( utf8"}\n')
    r = run(["eval", "--model", m, "--data", p, "--seq-len", "8"])
    assert r.returncode in (0, 1), r
    if r.returncode == 1:
        expect_error(["eval", "--model", m, "--data", p, "--seq-len", "8"], "bad_utf8.jsonl", ":2")
    p = write(base / "bad_utf8_chat.jsonl", b'{"messages": [{"role": "user", "content": "\xc0\xaf"}, '
                                             b'{"role": "assistant", "content": "ok \xed\xa0\x80"}]}\n')
    r = run(["eval", "--model", m, "--data", p, "--seq-len", "16"])
    assert r.returncode in (0, 1) and "Sanitizer" not in r.stderr, r


def test_one_gigabyte_line_is_refused_with_bounded_memory(base):
    """A 1 GiB line (a sparse file: no disk, no time to write) is read past,
    never stored: the error names the file and line, and memory stays low."""
    p = base / "gigaline.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"input_ids": [1, 2, 3]}\n{"text": "')
        f.truncate(f.tell() + (1 << 30))  # NULs, no newline: one 1 GiB line
        f.seek(0, 2)
        f.write(b'"}\n{"input_ids": [4, 5, 6]}\n')
    r = expect_error(["eval", "--model", base / "model", "--data", p, "--seq-len", "8"], "gigaline.jsonl", ":2",
                     max_rss=256 << 20, timeout=300)
    assert r.maxrss < 256 << 20


def test_seq_len_larger_than_max_position_embeddings(base):
    expect_error(["eval", "--model", base / "model", "--data", base / "tokens.jsonl", "--seq-len", "1000000"],
                 "max_position_embeddings")
    j = write_job(base / "job_seqlen.json", "model", "out_seqlen", "tokens.jsonl", T=4096)
    expect_error(["train", j], "seq_len", "max_position_embeddings")


def test_empty_dataset_for_training(base):
    write(base / "empty.jsonl", b"")
    j = write_job(base / "job_empty.json", "model", "out_empty", "empty.jsonl")
    expect_error(["train", j], "empty.jsonl")
    assert not (base / "out_empty" / "final").exists()


def test_dataset_shorter_than_a_batch_is_named(base):
    write(base / "one.jsonl", b'{"input_ids": [1]}\n')
    j = write_job(base / "job_one.json", "model", "out_one", "one.jsonl")
    r = run(["train", j])
    assert r.returncode in (0, 1) and "Sanitizer" not in r.stderr, r
    if r.returncode:
        expect_error(["train", j], "one.jsonl")


# ---------------------------------------------------------------------------
# job files and DeepSpeed configs with wrong types and bad values

JOB_TYPE_CASES = [
    ("model", 5, "model"),
    ("model", None, "model"),
    ("output_dir", ["a"], "output_dir"),
    ("data", "train.jsonl", "data"),
    ("data.seq_len", "512", "data.seq_len"),
    ("data.seq_len", -1, "data.seq_len"),
    ("data.seq_len", 1e300, "data.seq_len"),
    ("data.seq_len", 8.5, "data.seq_len"),
    ("data.packing", "yes", "data.packing"),
    ("data.format", "csv", "csv"),
    ("data.train", 3, "data.train"),
    ("data.train", "missing.jsonl", "missing.jsonl"),
    ("train.max_steps", "ten", "train.max_steps"),
    ("train.max_steps", -5, "train.max_steps"),
    ("train.max_steps", 1e30, "train.max_steps"),
    ("train.seed", "x", "train.seed"),
    ("train.seed", -1, "train.seed"),
    ("train.resume", 5, "train.resume"),
    ("train.save_steps", [1], "train.save_steps"),
    ("train.epochs", "one", "train.epochs"),
    ("lora", [], "lora"),
    ("lora.r", "8", "lora.r"),
    ("lora.r", 0, "lora.r"),
    ("lora.r", 1 << 40, "lora.r"),
    ("lora.lora_alpha", "big", "lora.lora_alpha"),
    ("lora.lora_dropout", 1.5, "lora.lora_dropout"),
    ("lora.target_modules", 5, "target_modules"),
    ("lora.target_modules", ["q_proj", 5], "target_modules"),
    ("lora.target_modules", [], "target_modules"),
    ("lora.init_from", "nowhere", "nowhere"),
    ("deepspeed", 5, "deepspeed"),
    ("deepspeed", "no-such-ds.json", "no-such-ds.json"),
    ("deepspeed.train_micro_batch_size_per_gpu", "two", "train_micro_batch_size_per_gpu"),
    ("deepspeed.train_micro_batch_size_per_gpu", 0, "train_micro_batch_size_per_gpu"),
    ("deepspeed.train_micro_batch_size_per_gpu", 1 << 40, "train_micro_batch_size_per_gpu"),
    ("deepspeed.gradient_accumulation_steps", -1, "gradient_accumulation_steps"),
    ("deepspeed.train_batch_size", 3, "train_batch_size"),
    ("deepspeed.gradient_clipping", "1.0", "gradient_clipping"),
    ("deepspeed.optimizer", {"type": "SGD"}, "SGD"),
    ("deepspeed.optimizer", {"type": "AdamW", "params": {"lr": "fast"}}, "lr"),
    ("deepspeed.optimizer", {"type": "AdamW", "params": {"betas": [0.9]}}, "betas"),
    ("deepspeed.scheduler", {"type": "WarmupLR", "params": {"warmup_num_steps": -3}}, "warmup_num_steps"),
    ("deepspeed.fp16", {"enabled": True, "initial_scale_power": 4000}, "initial_scale_power"),
    ("deepspeed.zero_optimization", {"stage": 4}, "stage"),
    ("deepspeed.zero_optimization", {"stage": 3, "offload_param": {"device": "disk"}}, "offload_param"),
    ("deepspeed.zero_optimization", {"stage": "two"}, "stage"),
    # lora_alpha must keep alpha / r a finite float (1e300 trained to NaN)
    ("lora.lora_alpha", 1e300, "lora.lora_alpha"),
    ("lora.lora_alpha", 0, "lora.lora_alpha"),
    ("lora.lora_alpha", -8, "lora.lora_alpha"),
    # the prefetch queue depth sizes an allocation: 0..1024
    ("data.prefetch", 1025, "data.prefetch"),
    ("data.prefetch", 1000000000, "0 to 1024"),
]


def set_path(d, path, value):
    keys = path.split(".")
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


@pytest.mark.parametrize("i", range(len(JOB_TYPE_CASES)))
def test_job_file_wrong_types_and_values(base, i):
    path, value, must = JOB_TYPE_CASES[i]
    name = "job_bad_%d.json" % i
    write_job(base / name, "model", "out_bad_%d" % i, "tokens.jsonl",
              lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    job = json.loads((base / name).read_text())
    set_path(job, path, value)
    write(base / name, json.dumps(job))
    expect_error(["train", base / name], name if not path.startswith("deepspeed.") else "deepspeed", must)
    assert not (base / ("out_bad_%d" % i) / "final").exists()


# numbers a double cannot hold: cJSON read them as 0 or infinity without a
# word (lr 1e-400 trained with lr 0). Written as raw text, since Python's json
# cannot write them.
RANGE_CASES = {
    "lr_underflow": ('"deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-400}}}',
                     "deepspeed.optimizer.params.lr is 1e-400"),
    "lr_overflow": ('"deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}}',
                    "deepspeed.optimizer.params.lr is 1e400"),
    "clipping_underflow": ('"deepspeed": {"gradient_clipping": 1e-999}', "deepspeed.gradient_clipping"),
    "beta_subnormal": ('"deepspeed": {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1e-310]}}}',
                       "deepspeed.optimizer.params.betas[1]"),
    "alpha_underflow": ('"lora": {"r": 2, "lora_alpha": 1e-400}', "lora.lora_alpha"),
}


@pytest.mark.parametrize("case", sorted(RANGE_CASES))
def test_job_numbers_out_of_double_range(base, case):
    text, must = RANGE_CASES[case]
    name = "job_range_%s.json" % case
    write(base / name, '{"model": "model", "output_dir": "out_range_%s", "data": {"train": "tokens.jsonl", '
                       '"seq_len": 8}, "train": {"max_steps": 1}, %s}' % (case, text))
    expect_error(["train", base / name], name, must)
    assert not (base / ("out_range_" + case)).exists()
    # the same in a DeepSpeed file names that file
    if text.startswith('"deepspeed": '):
        write(base / ("ds_range_%s.json" % case), text[len('"deepspeed": '):])
        j = write_job(base / ("job_dsrange_%s.json" % case), "model", "out_dsrange", "tokens.jsonl",
                      ds="ds_range_%s.json" % case)
        expect_error(["train", j], "ds_range_%s.json" % case, must[len("deepspeed."):])


RAW_JOB_CASES = {
    "empty": "",
    "not_object": "[1]",
    "truncated": '{"model": "model", "output_dir": "o", "data": {"train": "tok',
    "deep": "[" * NEST + "]" * NEST,
    "deep_in_deepspeed": '{"model": "model", "output_dir": "o", "data": {"train": "tokens.jsonl"}, "deepspeed": '
                         + "{\"a\":" * NEST + "1" + "}" * NEST + "}",
    "nul_in_middle": '{"model": "mo\u0000del"}',
    "invalid_utf8": b'{"model": "\xff\xfe", "output_dir": "o", "data": {"train": "tokens.jsonl"}}',
}


@pytest.mark.parametrize("case", sorted(RAW_JOB_CASES))
def test_unreadable_job_file(base, case):
    p = write(base / ("jobraw_%s.json" % case), RAW_JOB_CASES[case])
    expect_error(["train", p], "jobraw_%s.json" % case)


def test_oversized_job_and_ds_files(base):
    p = base / "job_huge.json"
    with open(p, "wb") as f:
        f.truncate(4 << 30)
    expect_error(["train", p], "job_huge.json")
    ds = base / "ds_huge.json"
    with open(ds, "wb") as f:
        f.truncate(4 << 30)
    j = write_job(base / "job_dshuge.json", "model", "out_dshuge", "tokens.jsonl", ds="ds_huge.json")
    expect_error(["train", j], "ds_huge.json")


BAD_SETS = ["train.max_steps", "train.max_steps=abc", "=5", "a..b=1", "data.seq_len=[1,2]",
            "train.max_steps=1e999", "data.seq_len=" + "[" * 10000]


@pytest.mark.parametrize("i", range(len(BAD_SETS)))
def test_bad_set_overrides(base, i):
    j = write_job(base / "job_sets.json", "model", "out_sets", "tokens.jsonl")
    expect_error(["train", j, "--set", BAD_SETS[i]], "--set")


# ---------------------------------------------------------------------------
# adapters and checkpoints

def test_bad_adapter_folder(base):
    ad = base / "bad_adapter"
    ad.mkdir(exist_ok=True)
    write(ad / "adapter_config.json", "[" * NEST + "]" * NEST)
    expect_error(eval_args(base / "model", base, "--adapter", ad), "adapter_config.json")
    write(ad / "adapter_config.json", json.dumps({"peft_type": "LORA", "r": -2, "lora_alpha": 4,
                                                  "target_modules": ["q_proj"]}))
    expect_error(eval_args(base / "model", base, "--adapter", ad), "adapter_config.json")
    write(ad / "adapter_config.json", json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                  "target_modules": ["q_proj"]}))
    write(ad / "adapter_model.safetensors", struct.pack("<Q", 1 << 63))
    expect_error(eval_args(base / "model", base, "--adapter", ad), "adapter_model.safetensors")
    import numpy as np
    import st
    st.write(str(ad / "adapter_model.safetensors"),
             {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 7), np.float32)})
    expect_error(eval_args(base / "model", base, "--adapter", ad), "lora_A")


@pytest.mark.parametrize("alpha", ["1e400", "1e-400", "1e300", "0", "-4"])
def test_adapter_lora_alpha_out_of_range(base, alpha):
    """eval --adapter and merge refuse an adapter_config.json lora_alpha that is
    not finite, rounds to 0 or infinity, or is not positive, by name."""
    import numpy as np
    import st
    ad = base / ("adapter_alpha_%s" % alpha)
    ad.mkdir(exist_ok=True)
    write(ad / "adapter_config.json", '{"peft_type": "LORA", "r": 2, "lora_alpha": %s, "target_modules": ["q_proj"]}'
          % alpha)
    st.write(str(ad / "adapter_model.safetensors"),
             {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 64), np.float32),
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 2), np.float32),
              "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": np.zeros((2, 64), np.float32),
              "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": np.zeros((64, 2), np.float32)})
    expect_error(eval_args(base / "model", base, "--adapter", ad), "adapter_config.json", "lora_alpha")
    out = base / ("merged_alpha_%s" % alpha)
    expect_error(["merge", "--model", base / "model", "--adapter", ad, "--out", out], "adapter_config.json",
                 "lora_alpha")
    assert not out.exists()


@pytest.fixture(scope="module")
def trained(base):
    """A LoRA run with a checkpoint at step 1 (to damage) and its job."""
    j = write_job(base / "ck.json", "model", "out_ck", "tokens.jsonl", train_opts={"max_steps": 1, "save_steps": 1},
                  lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    ok(["train", j])
    return j, base / "out_ck" / "checkpoint-1"


OPT = "optimizer-00000-of-00001.safetensors"  # the one part a single rank writes
CKPT_CASES = {
    "state_truncated": ("trainer_state.json", lambda b: b[:len(b) // 2]),
    "state_deep": ("trainer_state.json", lambda b: b"[" * NEST + b"]" * NEST),
    "state_step_negative": ("trainer_state.json", lambda b: b.replace(b'"step":\t1', b'"step":\t-4')),
    "state_step_string": ("trainer_state.json", lambda b: b.replace(b'"step":\t1', b'"step":\t"1"')),
    "state_numel_wrong": ("trainer_state.json", lambda b: re.sub(rb'"numel":\t\d+', b'"numel":\t7', b)),
    "state_world_huge": ("trainer_state.json", lambda b: b.replace(b'"world":\t1', b'"world":\t1000000000')),
    # 2^32 + 1 ranks: an int cast made it 1, matching the one data_position entry
    "state_world_2^32+1": ("trainer_state.json", lambda b: b.replace(b'"world":\t1', b'"world":\t4294967297')),
    "state_scale_zero": ("trainer_state.json", lambda b: re.sub(rb'"scale":\t[0-9.e+]+', b'"scale":\t0', b)),
    "optimizer_truncated": (OPT, lambda b: b[:len(b) - 100]),
    "optimizer_header_2^63": (OPT, lambda b: struct.pack("<Q", 1 << 63) + b[8:]),
    "optimizer_empty": (OPT, lambda b: b""),
    "optimizer_missing": (OPT, None),
    # a part of another checkpoint: same size, other range or block in the metadata
    "optimizer_range_wrong": (OPT, lambda b: b.replace(b'"range_lo":"0"', b'"range_lo":"9"')),
    "optimizer_numel_wrong": (OPT, lambda b: re.sub(rb'"numel":"(\d)', lambda m: b'"numel":"' + bytes([48 + (int(m.group(1)) + 1) % 10]), b, count=1)),
    "optimizer_part_wrong": (OPT, lambda b: b.replace(b'"part":"0"', b'"part":"1"')),
    "optimizer_f16": (OPT, lambda b: b.replace(b'"exp_avg":{"dtype":"F32"', b'"exp_avg":{"dtype":"F16"')),
    "adapter_truncated": ("adapter_model.safetensors", lambda b: b[:len(b) // 3]),
    "adapter_missing": ("adapter_model.safetensors", None),
}


@pytest.mark.parametrize("case", sorted(CKPT_CASES))
def test_damaged_checkpoint_on_resume(base, trained, case):
    job, ck = trained
    out = base / ("out_ck_" + case)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ck.parent, out)
    fname, fn = CKPT_CASES[case]
    target = out / "checkpoint-1" / fname
    if fn is None:
        os.remove(target)
    else:
        write(target, fn(target.read_bytes()))
    j = json.loads(open(job).read())
    j["output_dir"] = "out_ck_" + case
    j["train"]["max_steps"] = 3
    write(base / ("ck_%s.json" % case), json.dumps(j))
    # an optimizer file's error names that file
    expect_error(["train", base / ("ck_%s.json" % case)], "checkpoint-1", *([OPT] if fname == OPT else []))
    # the damaged checkpoint is left for the user to inspect, nothing else was written
    assert not (out / "checkpoint-2").exists()


def ckpt_resume_copy(base, trained, name, max_steps=3):
    """A copy of the trained run's output folder and a job resuming it to max_steps."""
    job, ck = trained
    out = base / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ck.parent, out)
    j = json.loads(open(job).read())
    j["output_dir"] = name
    j["train"]["max_steps"] = max_steps
    return write(base / (name + ".json"), json.dumps(j)), out


def ckpt_snapshot(out):
    """The names under the output folder, and every file of checkpoint-1 with
    its bytes and mtime (a rewrite with the same bytes shows too)."""
    ck = out / "checkpoint-1"
    return (sorted(str(p.relative_to(out)) for p in out.rglob("*")),
            {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(ck.iterdir())})


# format_version cases: (new value, or DELETE to drop the key; what the sentence must say)
DELETE = object()
VERSION_CASES = {
    "newer": (3, ["format_version 3", "newer qtune", "reads formats 1 to 2", "the qtune that wrote it", '"never"']),
    "much_newer": (2147483647, ["format_version 2147483647", "newer qtune", "reads formats 1 to 2"]),
    "missing": (DELETE, ['"format_version" is missing', "reads checkpoint formats 1 to 2", '"never"']),
    "string": ("2", ['"format_version" is "2" (a string)', "reads checkpoint formats 1 to 2"]),
    "fraction": (1.5, ['"format_version" is 1.5', "reads checkpoint formats 1 to 2"]),
    "zero": (0, ['"format_version" is 0', "reads checkpoint formats 1 to 2"]),
    "negative": (-2, ['"format_version" is -2', "reads checkpoint formats 1 to 2"]),
    "past_int": (2 ** 31, ['"format_version" is 2147483648', "reads checkpoint formats 1 to 2"]),
    "huge": (1e300, ['"format_version" is 1e+300', "reads checkpoint formats 1 to 2"]),
    "null": (None, ['"format_version" is not a number', "reads checkpoint formats 1 to 2"]),
    "object": ({"major": 3}, ['"format_version" is not a number']),
    # 1 MB with newlines and escapes: the sentence quotes a short printable prefix only
    "long_string": ("\n\x1b[2J" + "9" * (1 << 20), ['"format_version" is "??[2J999', '..." (a string)']),
}


@pytest.mark.parametrize("case", sorted(VERSION_CASES))
def test_checkpoint_format_version_on_resume(base, trained, case):
    """A checkpoint of a newer format, or a missing/mistyped/hostile
    format_version: one sentence naming trainer_state.json, the value found,
    the formats this qtune reads and what to do; exit 1; the checkpoint is
    left exactly as it was and nothing is added to the output folder."""
    job, out = ckpt_resume_copy(base, trained, "out_ckver_" + case)
    sp = out / "checkpoint-1" / "trainer_state.json"
    state = json.loads(sp.read_text())
    value, must = VERSION_CASES[case]
    if value is DELETE:
        del state["format_version"]
    else:
        state["format_version"] = value
    write(sp, json.dumps(state, indent="\t"))
    before = ckpt_snapshot(out)
    r = expect_error(["train", job], str(sp), *must, code=(1,))
    assert r.stderr.count("error") == 1, r
    assert ckpt_snapshot(out) == before


def test_format_2_without_optimizer_list_is_damaged(base, trained):
    """format_version 2 lists its optimizer parts; a state without the list is
    not read as format 1 (whose one optimizer.safetensors it does not have)."""
    job, out = ckpt_resume_copy(base, trained, "out_ckver_nolist")
    sp = out / "checkpoint-1" / "trainer_state.json"
    state = json.loads(sp.read_text())
    del state["optimizer"]
    write(sp, json.dumps(state, indent="\t"))
    before = ckpt_snapshot(out)
    expect_error(["train", job], str(sp), 'format_version 2', '"optimizer"', "damaged", code=(1,))
    assert ckpt_snapshot(out) == before


def test_format_1_checkpoint_still_resumes(base, trained):
    """The format before sharded optimizer parts (format_version 1: one
    optimizer.safetensors with the whole state, no "optimizer" list) still
    resumes, and continues exactly as the same checkpoint in format 2 does."""
    job2, out2 = ckpt_resume_copy(base, trained, "out_ckver_2", max_steps=2)
    job1, out1 = ckpt_resume_copy(base, trained, "out_ckver_1", max_steps=2)
    ck = out1 / "checkpoint-1"
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["format_version"] == 2 and [p["file"] for p in state["optimizer"]["parts"]] == [OPT]
    del state["optimizer"]
    state["format_version"] = 1
    # a single rank's one part holds exactly the format-1 file's two tensors (its metadata is not read)
    os.rename(ck / OPT, ck / "optimizer.safetensors")
    write(ck / "trainer_state.json", json.dumps(state, indent="\t"))
    os.remove(ck / "checksums.sha256")  # format 1 predates checkpoint checksums
    for j in (job1, job2):
        r = ok(["train", j])
        assert "resuming from" in r.stderr and "step 1 of 2" in r.stderr, r
    a1 = (out1 / "final" / "adapter_model.safetensors").read_bytes()
    assert a1 == (out2 / "final" / "adapter_model.safetensors").read_bytes()
    s1 = json.loads((out1 / "checkpoint-2" / "trainer_state.json").read_text())
    assert s1["format_version"] == 2 and s1["step"] == 2


def test_resume_from_a_path_that_is_not_a_checkpoint(base, trained):
    job, ck = trained
    j = json.loads(open(job).read())
    j["output_dir"] = "out_ck_badpath"
    j["train"]["resume"] = str(base / "model")
    write(base / "ck_badpath.json", json.dumps(j))
    expect_error(["train", base / "ck_badpath.json"], "train.resume")


def test_huge_data_positions_of_another_world_size(base, trained):
    """A state written by 1100 ranks, each at row 9e15 - 1 of epoch 0: the resume on
    one rank remaps the data position from their sum (1100 x 9e15 > 2^63), which
    overflowed int64 (UB; fatal under QTUNE_ASAN_BIN). Such positions cannot be
    the first G rows of an epoch, so the data restarts at rank 0's epoch."""
    job, ck = trained
    out = base / "out_ck_huge_pos"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ck.parent, out)
    sp = out / "checkpoint-1" / "trainer_state.json"
    st = json.loads(sp.read_text())
    st["world"] = 1100
    st["data_position"] = [[0, 8999999999999999]] * 1100
    write(sp, json.dumps(st))
    os.remove(out / "checkpoint-1" / "checksums.sha256")  # an edited state: resumed unchecked, with a warning
    j = json.loads(open(job).read())
    j["output_dir"] = "out_ck_huge_pos"
    j["train"]["max_steps"] = 2
    write(base / "ck_huge_pos.json", json.dumps(j))
    r = ok(["train", base / "ck_huge_pos.json"])
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r
    assert "restarts from the same epoch position of rank 0" in r.stderr, r
    assert (out / "checkpoint-2").is_dir()


# ---------------------------------------------------------------------------
# command lines

BAD_ARGV = [
    ["eval"],
    ["eval", "--model"],
    ["eval", "--model", "/nonexistent", "--data", "x.jsonl"],
    ["eval", "--seq-len", "-3", "--model", "m", "--data", "d"],
    ["eval", "--seq-len", "99999999999999999999", "--model", "m", "--data", "d"],
    ["eval", "--batch", "0", "--model", "m", "--data", "d"],
    ["generate", "--model", "/nonexistent", "--prompt", "hi"],
    ["generate", "--max-new", "-1", "--model", "m", "--prompt", "x"],
    ["generate", "--temperature", "nan", "--model", "m", "--prompt", "x"],
    ["tokenize", "--tokenizer", "/nonexistent.json", "--text", "x"],
    ["init", "--out", "/proc/forbidden/x", "--preset", "tiny"],
    ["init", "--out", "x", "--preset", "no-such-preset"],
    ["plan", "--preset", "tiny", "--devices", "0"],
    ["plan", "--preset", "tiny", "--micro-batch", "1e99"],
    ["merge", "--model", "/nonexistent", "--adapter", "/nonexistent", "--out", "o"],
    ["train"],
    ["train", "/nonexistent/job.json"],
    ["nosuchcommand"],
]


@pytest.mark.parametrize("i", range(len(BAD_ARGV)))
def test_bad_command_lines(base, i):
    expect_error(BAD_ARGV[i], cwd=base)


# ---------------------------------------------------------------------------
# the token cache: a damaged cache is rebuilt, never trusted

CACHE_DAMAGE = {
    "truncated": lambda b: b[:len(b) // 2],
    "empty": lambda b: b"",
    "garbage": lambda b: bytes((i * 37) & 255 for i in range(len(b))),
    "flipped_ids": lambda b: b[:len(b) - 40] + bytes(x ^ 0xFF for x in b[len(b) - 40:len(b) - 20]) + b[len(b) - 20:],
    "header_only": lambda b: b[:120],
    "grown": lambda b: b + b"\0" * 4096,
}


@pytest.mark.parametrize("case", sorted(CACHE_DAMAGE))
def test_damaged_token_cache_is_rebuilt(base, case):
    d = base / ("cache_" + case)
    d.mkdir(exist_ok=True)
    write_tokens(d / "train.jsonl", n=6, seed=3)
    j = write_job(d / "job.json", str(base / "model"), "out", "train.jsonl", train_opts={"max_steps": 1})
    ok(["train", j])
    caches = [p for p in (d / ".qtune-cache").iterdir() if p.name.endswith(".qtc")]
    assert len(caches) == 1
    first = json.loads((d / "out" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    caches[0].write_bytes(CACHE_DAMAGE[case](caches[0].read_bytes()))
    r = ok(["train", j, "--set", "train.overwrite_output_dir=true"])
    assert "Sanitizer" not in r.stderr
    again = json.loads((d / "out" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert again == first  # the rebuilt tokens are the same tokens


# ---------------------------------------------------------------------------
# generate: hostile prompts and chat input

def test_generate_with_hostile_text(base):
    m = model_copy(base, "gen_model")
    shutil.copy(base / "tiny-tokenizer.json", m / "tokenizer.json")
    for raw in [b"x\xff\xc3", b"<|im_end|><|im_start|>" * 50, b"a" * 20000, b"\xed\xa0\x80\xf4\x90\x80\x80"]:
        args = ["generate", "--model", m, "--prompt", os.fsdecode(raw), "--max-new", "3", "--temperature", "0"]
        r = run(args)
        assert r.returncode in (0, 1) and "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r
        if r.returncode:
            expect_error(args)
    stdin = b"hello \xff\xfe\x00 there\n\n" + b"a" * 100000 + b"\n\xc3\n"
    r = run(["generate", "--model", m, "--chat", "--max-new", "2", "--temperature", "0"], stdin=stdin)
    assert r.returncode in (0, 1) and "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r


def test_merge_with_a_bad_adapter_writes_nothing(base, trained):
    """merge refuses a damaged adapter, and an existing --out folder is left as it was."""
    job, ck = trained
    good = ck  # a checkpoint of a LoRA run is a PEFT adapter folder
    out = base / "merged"
    ok(["merge", "--model", base / "model", "--adapter", good, "--out", out])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    bad = base / "merge_bad_adapter"
    if bad.exists():
        shutil.rmtree(bad)
    shutil.copytree(good, bad)
    full = (bad / "adapter_model.safetensors").read_bytes()
    for damage in (full[:len(full) // 2], struct.pack("<Q", 1 << 63) + full[8:], b""):
        write(bad / "adapter_model.safetensors", damage)
        expect_error(["merge", "--model", base / "model", "--adapter", bad, "--out", out], "adapter_model.safetensors")
        after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert after == before
