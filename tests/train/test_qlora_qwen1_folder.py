"""The recipe's QLoRA path at a CI shape, end to end from `qtune init`: an original-Qwen folder
(QWenLMHeadModel, fused c_attn) written with its qwen.tiktoken by `qtune init --tokenizer`, text data
tokenized by that tiktoken, the base quantized to NF4 (double quant) as it loads, LoRA r 8 / alpha 32
on c_attn with recomputation, a checkpoint, and a resume that ends bit for bit where one run does.
bench/qlora_14b.sh runs the same commands at Qwen-14B's shape (bench/RESULTS-qlora-14b.md)."""
import base64
import json
import os

import numpy as np

from trainutil import init_model, run, st, step_lines

# a small tiktoken vocabulary: the 256 bytes in a shuffled order (rank is not byte value), then words
# each made of two lower-ranked tokens, as in tests/io/test_export_gguf.py's qwen1 fixture
WORDS = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" a", b" and", b"er", b"re",
         b"on", b"hel", b"ll", b"lo", b"llo", b"hello"]


def write_tiktoken(path, n_extra_bytes=0):
    byts = list(range(256))
    np.random.default_rng(1).shuffle(byts)
    toks = [bytes([b]) for b in byts] + WORDS + [b"x" * (k + 2) for k in range(n_extra_bytes)]
    with open(path, "w") as f:
        for i, t in enumerate(toks):
            f.write("%s %d\n" % (base64.b64encode(t).decode(), i))
    return len(toks)


def test_init_writes_the_original_qwen_tokenizer(tmp_path):
    """`qtune init --tokenizer X.tiktoken` on an original-Qwen shape writes DIR/qwen.tiktoken (the bytes given)
    and the tokenizer_config.json Qwen's folders carry; qtune tokenizes with it (the specials follow the ranks);
    a Qwen2 shape, or a vocabulary whose ids do not fit, is refused before anything is written."""
    tk = str(tmp_path / "vocab.tiktoken")
    n = write_tiktoken(tk)
    m = str(tmp_path / "m")
    run("init", "--out", m, "--preset", "tiny-qwen", "--tokenizer", tk)
    assert open(os.path.join(m, "qwen.tiktoken"), "rb").read() == open(tk, "rb").read()
    assert not os.path.exists(os.path.join(m, "tokenizer.json"))
    tc = json.load(open(os.path.join(m, "tokenizer_config.json")))
    assert tc["tokenizer_class"] == "QWenTokenizer"
    assert tc["auto_map"]["AutoTokenizer"] == ["tokenization_qwen.QWenTokenizer", None]
    cfg = json.load(open(os.path.join(m, "config.json")))
    assert cfg["model_type"] == "qwen" and cfg["eos_token_id"] == n  # <|endoftext|>, the first id after the ranks
    p = run("tokenize", "--tokenizer", m, "--text", "hello the<|im_end|>", "--json")
    ids = json.loads(p.stdout)["ids"]
    assert ids[-1] == n + 2 and n - 1 in ids, ids  # <|im_end|>; "hello" is the last rank

    p = run("init", "--out", str(tmp_path / "q2"), "--preset", "tiny", "--tokenizer", tk, check=False)
    assert p.returncode != 0 and "the original Qwen's tokenizer" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "q2")
    big = str(tmp_path / "big.tiktoken")
    write_tiktoken(big, n_extra_bytes=60)  # 335 ranks + 208 specials > vocab 512
    p = run("init", "--out", str(tmp_path / "q3"), "--preset", "tiny-qwen", "--tokenizer", big, check=False)
    assert p.returncode != 0 and "vocab_size is 512" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "q3")


def test_qlora_on_an_init_qwen1_folder_checkpoints_and_resumes_bit_for_bit(tmp_path):
    d = str(tmp_path)
    tk = os.path.join(d, "qwen.tiktoken")
    write_tiktoken(tk)
    run("init", "--out", os.path.join(d, "model"), "--preset", "tiny-qwen", "--dtype", "bf16", "--seed", "5",
        "--tokenizer", tk)
    rng = np.random.default_rng(2)
    words = [w.decode() for w in WORDS]
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for _ in range(24):
            f.write(json.dumps({"text": "".join(rng.choice(words, size=int(rng.integers(6, 20))))}) + "\n")
    finals, losses = [], []
    for out, stops in (("one", [4]), ("two", [2, 4])):
        for s in stops:
            job = {"model": "model", "output_dir": out,
                   "data": {"train": "train.jsonl", "seq_len": 32, "packing": False, "shuffle": False},
                   "lora": {"r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["c_attn"]},
                   "quantization": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"},
                   "train": {"max_steps": s, "save_steps": 2, "log_steps": 1, "seed": 7,
                             "gradient_checkpointing": True},
                   "deepspeed": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                 "bf16": {"enabled": True},
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}}
            with open(os.path.join(d, "job.json"), "w") as f:
                json.dump(job, f)
            p = run("train", os.path.join(d, "job.json"))
            assert "4-bit base: 10 matrices" in p.stderr, p.stderr  # 2 layers x c_attn, c_proj, w1, w2, mlp.c_proj
            if out == "two" and s == 4:
                assert "resuming from" in p.stderr and "(step 2 of 4)" in p.stderr, p.stderr
        assert os.path.isdir(os.path.join(d, out, "checkpoint-2"))
        finals.append(st.read(os.path.join(d, out, "final", "adapter_model.safetensors")))
        losses.append([m["loss"] for m in step_lines(os.path.join(d, out))][-2:])
    assert set(finals[0]) == {"base_model.model.transformer.h.%d.attn.c_attn.lora_%s.weight" % (l, ab)
                              for l in range(2) for ab in "AB"}
    for k in finals[0]:
        assert np.array_equal(finals[0][k], finals[1][k]), k
    assert losses[0] == losses[1], losses
