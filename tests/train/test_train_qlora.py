"""QLoRA: LoRA on a base whose layer linears are quantized to 4 bits as they
load (job key "quantization", transformers' BitsAndBytesConfig names), held
against the PyTorch reference (tests/ref, float64) run on the dequantized
weights: 20 steps, losses and the LoRA weights within 1e-4, as
test_train_ref.py holds the 16-bit base. The dequantized folder is made with
tests/quant/bnb_ref.py, the reference quantizer that core/quant4.c equals bit
for bit (tests/quant/test_quant4_ref.py)."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from trainutil import init_model, run, st, step_lines, write_job, write_tokens

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)
import test_train_ref as R

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "quant"))
import bnb_ref  # noqa: E402


def dequantized_folder(src, dst, qtype, nested):
    """A copy of the model folder src whose decoder-layer matrices are replaced by their 4-bit round trip."""
    shutil.copytree(src, dst)
    w = st.read(os.path.join(src, "model.safetensors"))
    code4 = bnb_ref.NF4 if qtype == "nf4" else bnb_ref.FP4
    code8 = bnb_ref.create_dynamic_map()
    n_q = 0
    for k, v in w.items():
        if v.ndim != 2 or not (".layers." in k or k.startswith("transformer.h.")):
            continue  # embeddings, lm_head and norms stay 16-bit, as transformers keeps them
        packed, absmax = bnb_ref.quantize_4bit(v.reshape(-1), qtype, 64)
        if nested:
            off, q, am2 = bnb_ref.double_quant(absmax, code8)
            absmax = bnb_ref.nested_absmax(q, am2, code8, off)
        w[k] = bnb_ref.dequantize_4bit(packed, absmax, code4, v.size, 64).reshape(v.shape)
        n_q += 1
    assert n_q > 0
    st.write(os.path.join(dst, "model.safetensors"), w)
    return dst


@pytest.mark.parametrize("preset,qtype,nested", [("tiny", "nf4", True), ("tiny-qwen3", "fp4", False),
                                                 ("tiny-qwen", "nf4", True)])
def test_qlora_20_steps_match_reference_on_dequantized_base(tmp_path, preset, qtype, nested):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    rows = write_tokens(os.path.join(d, "train.jsonl"), R.N_EX, R.T, seed=11, min_len=5)
    cfg = json.load(open(os.path.join(model, "config.json")))
    C, H, r = cfg["hidden_size"], cfg["num_attention_heads"], 4
    if cfg["model_type"] == "qwen":  # the original Qwen: fused c_attn (its k and v are views of one 4-bit block)
        D, I = cfg["kv_channels"], cfg["intermediate_size"] // 2
        targets = ["c_attn", "c_proj"]
        mods = [("transformer.h.%d.attn.c_attn", C, 3 * H * D), ("transformer.h.%d.attn.c_proj", H * D, C),
                ("transformer.h.%d.mlp.c_proj", I, C)]
    else:
        D, KV = cfg.get("head_dim") or C // H, cfg["num_key_value_heads"]
        targets = ["q_proj", "v_proj"]
        mods = [("model.layers.%d.self_attn.q_proj", C, H * D), ("model.layers.%d.self_attn.v_proj", C, KV * D)]
    rng = np.random.default_rng(5)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for mod, fan_in, out in mods:
            key = "base_model.model." + mod % l
            w[key + ".lora_A.weight"] = (rng.standard_normal((r, fan_in)) * 0.2).astype(np.float32)
            w[key + ".lora_B.weight"] = (rng.standard_normal((out, r)) * 0.2).astype(np.float32)
    ad = os.path.join(d, "adapter0")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"), w)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
               "target_modules": targets, "task_type": "CAUSAL_LM"},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    lora = {"r": r, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets, "init_from": "adapter0"}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=R.T, lora=lora, ds=R.DS,
                    train_opts={"max_steps": R.STEPS})
    j = json.load(open(job))
    j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": qtype, "bnb_4bit_use_double_quant": nested,
                         "bnb_4bit_compute_dtype": "float32"}
    json.dump(j, open(job, "w"))
    run("train", job)

    deq = dequantized_folder(model, os.path.join(d, "deq"), qtype, nested)
    ref = qwen1_ref.reference(deq, dtype=torch.float64, lora={"r": r, "alpha": 8, "weights": w})
    losses = R.reference(ref, rows)
    final = st.read(os.path.join(d, "out", "final", "adapter_model.safetensors"))
    assert set(final) == set(w)
    ours = {k: (final[k], ref.lp[k].detach().numpy()) for k in final}
    worst = R.check(ours, losses, os.path.join(d, "out"))
    print("QLoRA %s %s nested=%s: max |w - w_ref| = %.3g" % (preset, qtype, nested, worst))


def test_qlora_differs_from_the_16bit_base(tmp_path):
    """The quantization is really applied: the first loss on the 4-bit base is not the 16-bit base's."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    losses = []
    for q in (None, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}):
        out = os.path.join(d, "out%d" % len(losses))
        job = write_job(os.path.join(d, "job.json"), "model", out, "train.jsonl", lora=lora,
                        train_opts={"max_steps": 1})
        j = json.load(open(job))
        if q:
            j["quantization"] = q
        json.dump(j, open(job, "w"))
        p = run("train", job)
        losses.append(step_lines(out)[0]["loss"])
        if q:  # quantized one tensor at a time, with its sizes said once (tiny: 2 layers x 7 linears)
            assert "4-bit base: 14 matrices" in p.stderr, p.stderr
        else:
            assert "4-bit base" not in p.stderr
    assert losses[0] != losses[1]


@pytest.mark.parametrize("quant,msg", [
    ({"load_in_8bit": True}, "8-bit (LLM.int8) bases are not supported"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "must be \"nf4\" or \"fp4\""),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16"}, "bnb_4bit_compute_dtype is bf16 but the run"),
])
def test_quantization_refusals(tmp_path, quant, msg):
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl",
                    lora={"r": 4, "target_modules": ["q_proj"]})
    j = json.load(open(job))
    j["quantization"] = quant
    json.dump(j, open(job, "w"))
    p = run("train", job, check=False)
    assert p.returncode != 0 and msg in p.stderr, p.stderr


def test_full_finetuning_on_a_4bit_base_is_refused(tmp_path):
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl")
    j = json.load(open(job))
    j["quantization"] = {"load_in_4bit": True}
    json.dump(j, open(job, "w"))
    p = run("train", job, check=False)
    assert p.returncode != 0 and "full fine-tuning cannot update it" in p.stderr, p.stderr


@pytest.mark.parametrize("compute", ["bf16", "fp16"])
def test_qlora_half_compute_equals_the_16bit_path_on_dequantized_weights(tmp_path, compute, monkeypatch):
    """bf16/fp16 compute: the 4-bit weights dequantize to the compute dtype, as bitsandbytes'
    dequantize_4bit returns quant_state.dtype; 20 steps equal qtune's 16-bit path (held against PyTorch by
    tests/precision) on a folder of those dequantized values, losses and adapter within 1e-4. Both runs take
    the fp32 path (QTUNE_BF16_EMULATE: bf16 values, fp32 products), so the two differ only in where the
    weights come from; a summation order that differs between two GEMM routes made the adapters drift apart
    by ~2e-4 over 20 Adam steps (unit/test_precision holds the 4-bit bf16 GEMM path against the fp32 one on
    one step)."""
    monkeypatch.setenv("QTUNE_BF16_EMULATE", "1")
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), R.N_EX, R.T, seed=11, min_len=5)
    ds = dict(R.DS)
    ds[compute] = {"enabled": True, "initial_scale_power": 12} if compute == "fp16" else {"enabled": True}
    deq = dequantized_folder(model, os.path.join(d, "deq"), "nf4", True)
    w = st.read(os.path.join(deq, "model.safetensors"))
    tdt = torch.bfloat16 if compute == "bf16" else torch.float16
    for k, v in w.items():  # the values the 4-bit path multiplies: rounded once more, to the compute dtype
        if v.ndim == 2 and ".layers." in k:
            w[k] = torch.from_numpy(v).to(tdt).float().numpy()
    st.write(os.path.join(deq, "model.safetensors"), w)
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    outs = []
    for m, q in (("model", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}),
                 ("deq", None)):
        out = "out_" + m
        job = write_job(os.path.join(d, "job.json"), m, out, "train.jsonl", T=R.T, lora=lora, ds=ds,
                        train_opts={"max_steps": R.STEPS})
        j = json.load(open(job))
        if q:
            j["quantization"] = q
        json.dump(j, open(job, "w"))
        run("train", job)
        outs.append(os.path.join(d, out))
    la, lb = ([x["loss"] for x in step_lines(o)] for o in outs)
    assert len(la) == R.STEPS
    for s, (a, b) in enumerate(zip(la, lb)):
        assert abs(a - b) <= 1e-4 * abs(b), "step %d: %.8f vs %.8f" % (s + 1, a, b)
    fa, fb = (st.read(os.path.join(o, "final", "adapter_model.safetensors")) for o in outs)
    for k in fa:
        assert np.allclose(fa[k], fb[k], rtol=1e-4, atol=1e-4), k


def test_eval_and_generate_read_the_4bit_base(tmp_path):
    """qtune eval and generate --quantization: the adapter trained on the 4-bit base evaluated and decoded on
    it equals the same on the folder of the dequantized weights (eval: the batched forward, generate: the
    decode's matvec over 4-bit rows)."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl",
                    lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
                    train_opts={"max_steps": 3})
    j = json.load(open(job))
    j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    json.dump(j, open(job, "w"))
    run("train", job)
    deq = dequantized_folder(model, os.path.join(d, "deq"), "nf4", True)
    ad = os.path.join(d, "out", "final")
    q = ["--quantization", "nf4", "--double-quant"]
    data = os.path.join(d, "train.jsonl")
    e4 = json.loads(run("eval", "--model", model, "--adapter", ad, "--data", data, "--seq-len", 16, *q)
                    .stdout.strip().splitlines()[-1])
    e16 = json.loads(run("eval", "--model", deq, "--adapter", ad, "--data", data, "--seq-len", 16)
                     .stdout.strip().splitlines()[-1])
    e0 = json.loads(run("eval", "--model", model, "--adapter", ad, "--data", data, "--seq-len", 16)
                    .stdout.strip().splitlines()[-1])
    assert abs(e4["loss"] - e16["loss"]) <= 1e-6 * e16["loss"], (e4, e16)
    assert e4["loss"] != e0["loss"]  # the 16-bit base gives another loss: the 4 bits are really read
    gen = ["generate", "--adapter", ad, "--prompt-ids", "5,6,7,8", "--max-new", 24, "--temperature", 1.0,
           "--seed", 3]
    g4 = run(*gen, "--model", model, *q).stdout.split()
    g16 = run(*gen, "--model", deq).stdout.split()
    assert len(g4) == 24 and g4 == g16
    p = run("eval", "--model", model, "--data", data, "--quantization", "int8", check=False)
    assert p.returncode != 0 and "--quantization must be nf4, fp4 or none" in p.stderr


def test_qlora_checkpoint_resume_equals_one_run(tmp_path):
    """A QLoRA run stopped at step 3 and resumed to 6 ends with the adapter of a 6-step run: the 4-bit base is
    quantized again on resume, the same bits."""
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 16, 16, seed=3)
    finals = []
    for out, steps in (("one", [6]), ("two", [3, 6])):
        for s in steps:
            job = write_job(os.path.join(d, "job.json"), "model", out, "train.jsonl",
                            lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                            train_opts={"max_steps": s, "save_steps": 3})
            j = json.load(open(job))
            j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}
            json.dump(j, open(job, "w"))
            p = run("train", job)
            if s == 6 and out == "two":
                assert "resuming from" in p.stderr and "(step 3 of 6)" in p.stderr, p.stderr
        finals.append(st.read(os.path.join(d, out, "final", "adapter_model.safetensors")))
        assert len(step_lines(os.path.join(d, out))) >= 3
    for k in finals[0]:
        assert np.array_equal(finals[0][k], finals[1][k]), k


def mpi_ok():
    import shutil
    if not shutil.which("mpirun"):
        return False
    cfg = os.path.join(os.environ.get("QTUNE_BUILD_DIR", ""), "generated", "qtune_config.h")
    return not os.path.exists(cfg) or "QTUNE_HAVE_MPI 1" in open(cfg).read()


@pytest.mark.skipif(not mpi_ok(), reason="needs mpirun and a qtune built with MPI")
def test_qlora_two_ranks_zero2_equal_one_rank(tmp_path):
    """ZeRO-2 over two ranks with a 4-bit base: each rank quantizes its own copy of the base (replicated), the
    adapter's gradients and Adam state are sharded; losses equal one rank with twice the accumulation."""
    import subprocess
    from trainutil import QTUNE, env
    d = str(tmp_path)
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 32, 16, seed=4, min_len=5)
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 2}}
    job = write_job(os.path.join(d, "job.json"), "model", "out2", "train.jsonl", ds=ds,
                    lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
                    train_opts={"max_steps": 4})
    j = json.load(open(job))
    j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    json.dump(j, open(job, "w"))
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    run("train", job, "--set", "output_dir=out1")
    m2, m1 = step_lines(os.path.join(d, "out2")), step_lines(os.path.join(d, "out1"))
    assert len(m2) == len(m1) == 4
    for a, b in zip(m2, m1):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
        assert a["opt_state_bytes"] < 0.6 * b["opt_state_bytes"]
    w2 = st.read(os.path.join(d, "out2", "final", "adapter_model.safetensors"))
    w1 = st.read(os.path.join(d, "out1", "final", "adapter_model.safetensors"))
    for k in w1:
        assert np.allclose(w2[k], w1[k], rtol=1e-4, atol=3e-5), k


def test_skip_modules_load_16bit(tmp_path):
    """llm_int8_skip_modules: down_proj stays 16-bit (12 of the tiny model's 14 linears are quantized); an
    unknown module name is refused by name."""
    d = str(tmp_path)
    init_model(os.path.join(d, "model"), "tiny")
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=3)
    for skip, ok in ((["model.layers.0.mlp.down_proj", "lm_head"], True), (["mlp.down_projj"], False)):
        job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl",
                        lora={"r": 4, "target_modules": ["q_proj"]}, train_opts={"max_steps": 1})
        j = json.load(open(job))
        j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "llm_int8_skip_modules": skip}
        json.dump(j, open(job, "w"))
        p = run("train", job, check=ok)
        if ok:
            assert "4-bit base: 12 matrices" in p.stderr, p.stderr
        else:
            assert p.returncode != 0 and "down_projj" in p.stderr, p.stderr
