"""qtune plan: the CLI's sums and options, the field report's strategies, and the plan against the
memory `qtune train` really uses: on three small shapes (full, LoRA, full with recomputation) the
plan's cpu_rank_bytes (one rank on the CPU backend) is within 10% of metrics.jsonl's mem_peak_bytes."""
import json
import os
import re

import numpy as np
import pytest

from conftest import qtune

GIB = 1024 ** 3


def cfg(V, C, I, L, H, KV):
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": V, "hidden_size": C,
            "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
            "use_sliding_window": False}


# name: (config, lora, micro-batch, seq_len, checkpointing)
SHAPES = {
    "full": (cfg(8192, 256, 688, 4, 4, 2), None, 2, 64, False),
    "lora": (cfg(16384, 384, 1024, 4, 6, 2), {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1,
                                              "target_modules": ["q_proj", "v_proj"]}, 2, 128, False),
    "full-recompute": (cfg(8192, 256, 688, 6, 4, 2), None, 4, 128, True),
    # PEFT's modules_to_save: the (tied) embedding and lm_head trained as two copies beside the adapter,
    # with their gradients and Adam state
    "lora-modules-to-save": (cfg(16384, 384, 1024, 4, 6, 2),
                             {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
                              "modules_to_save": ["embed_tokens", "lm_head"]}, 2, 128, False),
}


def write_shape_job(tmp_path, name, ds_extra=None):
    """The model of SHAPES[name] (qtune init), 4 micro-batches of random ids and a 2-step job over them in
    tmp_path/job.json (output out/); returns the job as a dict."""
    c, lora, B, T, ckpt = SHAPES[name]
    (tmp_path / "config.json").write_text(json.dumps(c))
    qtune("init", "--out", tmp_path / "m", "--config", tmp_path / "config.json", "--seed", 1, check=0)
    rng = np.random.default_rng(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(4 * B):
            f.write(json.dumps({"input_ids": [int(x) for x in rng.integers(1, c["vocab_size"] - 1, T + 1)]}) + "\n")
    job = {"model": "m", "output_dir": "out",
           "data": {"train": "train.jsonl", "seq_len": T, "packing": False, "shuffle": False},
           "train": {"max_steps": 2, "log_steps": 1, "seed": 1, "save_steps": 0, "gradient_checkpointing": ckpt},
           "deepspeed": dict({"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1},
                             **(ds_extra or {}))}
    if lora:
        job["lora"] = lora
    (tmp_path / "job.json").write_text(json.dumps(job))
    return job


@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_matches_measured_peak(tmp_path, name):
    _, lora, B, T, ckpt = SHAPES[name]
    write_shape_job(tmp_path, name)
    qtune("train", tmp_path / "job.json", check=0, env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        measured = max(json.loads(l).get("mem_peak_bytes", 0) for l in f if l.strip())
    args = ["plan", "--model", tmp_path / "m", "--micro-batch", B, "--seq-len", T, "--json"]
    if lora:
        args += ["--mode", "lora", "--lora-r", lora["r"], "--lora-targets", ",".join(lora["target_modules"])]
        if lora.get("modules_to_save"):
            args += ["--modules-to-save", ",".join(lora["modules_to_save"])]
    if ckpt:
        args += ["--checkpointing"]
    plan = json.loads(qtune(*args, check=0).stdout)
    predicted = plan["cpu_rank_bytes"]
    err = (predicted - measured) / measured
    print(f"{name}: predicted {predicted / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB ({err:+.1%})")
    assert abs(err) <= 0.10, f"{name}: plan {predicted} vs measured {measured} ({err:+.1%})\n{plan}"


@pytest.mark.parametrize("prec", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_matches_device_peak(tmp_path, name, prec):
    """A backend with its own device memory writes metrics.jsonl's device_peak_bytes (the most device bytes it
    held at once); the plan's per-device total for that backend predicts it within 10%. The guard backend's
    device memory is its own reservation, so this runs on every machine; on a GPU scripts/gpu-check runs the
    same comparison for cuda (tests/gpu/test_gpu_train.py). The CPU backend writes no device_peak_bytes."""
    job = write_shape_job(tmp_path, name, {"fp16": {"enabled": True}} if prec == "fp16" else None)
    qtune("train", tmp_path / "job.json", check=0, env={"QTUNE_BACKEND": "guard", "OMP_NUM_THREADS": "1"})
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        lines = [json.loads(l) for l in f if l.strip()]
    measured = max(l.get("device_peak_bytes", 0) for l in lines)
    plan = json.loads(qtune("plan", tmp_path / "job.json", "--device", "guard", "--json", check=0).stdout)
    predicted = plan["per_device_bytes"]["total"]
    err = (predicted - measured) / measured
    print(f"{name} {prec}: planned {predicted / 2**20:.2f} MiB, device peak {measured / 2**20:.2f} MiB ({err:+.1%})")
    assert abs(err) <= 0.10, f"{name} {prec}: plan {predicted} vs device peak {measured} ({err:+.1%})\n{plan}"
    if name == "full" and prec == "fp32":  # the cpu backend: no device memory of its own, no key
        job["output_dir"] = "out-cpu"
        (tmp_path / "job-cpu.json").write_text(json.dumps(job))
        qtune("train", tmp_path / "job-cpu.json", check=0, env={"QTUNE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"})
        with open(tmp_path / "out-cpu" / "metrics.jsonl") as f:
            assert not any("device_peak_bytes" in json.loads(l) for l in f if l.strip())


def plan_json(*args):
    return json.loads(qtune("plan", *args, "--json", check=0).stdout)


def test_plan_counts_openblas_buffers_per_thread():
    """issue 42 item 7: OpenBLAS maps a 128 MiB buffer per calling thread, which
    ulimit -v counts; the plan says how much, for this machine's thread count"""
    for threads in (1, 3):
        p = qtune("plan", "--preset", "qwen2.5-0.5b", "--json", check=0, env={"OMP_NUM_THREADS": str(threads)})
        j = json.loads(p.stdout)
        assert j["cpu_threads"] == threads and j["cpu_blas_address_space_bytes"] == threads * 134225920
    text = qtune("plan", "--preset", "qwen2.5-0.5b", check=0, env={"OMP_NUM_THREADS": "3"}).stdout
    assert "address space (ulimit -v) 0.375 GiB more: OpenBLAS maps a 128 MiB buffer for each of 3" in text, text


def test_cpu_rank_counts_the_process_runtime():
    """cpu_rank_bytes = device total + mapped weights + cpu_runtime_bytes (1 rank, no offload); the runtime is
    6 MiB with every product on OpenBLAS and 16 MiB where the input gradients run on oneDNN's sgemm."""
    args = ("--preset", "qwen2.5-0.5b", "--precision", "fp32", "--mode", "lora")
    ob = json.loads(qtune("plan", *args, "--json", check=0, env={"QTUNE_SGEMM": "openblas"}).stdout)
    assert ob["cpu_runtime_bytes"] == 6 << 20
    # the CPU process reads Qwen2.5-0.5B's bf16 base from the mapping (the device figure counts it in f32)
    assert ob["cpu_rank_bytes"] < ob["per_device_bytes"]["total"] + ob["cpu_runtime_bytes"]
    auto = json.loads(qtune("plan", *args, "--json", check=0, env={"QTUNE_SGEMM": "auto"}).stdout)
    assert auto["cpu_runtime_bytes"] in (6 << 20, 16 << 20)  # 16 where oneDNN loads
    assert auto["cpu_rank_bytes"] - ob["cpu_rank_bytes"] == auto["cpu_runtime_bytes"] - (6 << 20)


def test_categories_add_up_and_zero_shards():
    z = {s: plan_json("--preset", "qwen2.5-7b", "--precision", "bf16", "--zero", s, "--devices", 4)
         for s in ("0", "1", "2")}
    for p in z.values():
        d = p["per_device_bytes"]
        assert d["total"] == sum(v for k, v in d.items() if k != "total")
    P = z["0"]["n_trainable"]
    assert z["0"]["per_device_bytes"]["optimizer_state"] == 8 * P
    assert abs(z["1"]["per_device_bytes"]["optimizer_state"] - 2 * P) <= 4
    assert z["1"]["per_device_bytes"]["gradients"] == 4 * P
    # ZeRO 2 on 4 devices: the rank's fp32 shard (P bytes) + the model's two gradient windows (a layer each)
    g2 = z["2"]["per_device_bytes"]["gradients"]
    assert P < g2 < 1.3 * P, (g2, P)
    # ZeRO 1/2 shard the fp32 master too (f16/bf16 full fine-tuning: each rank keeps its quarter, as DeepSpeed),
    # and offload moves that shard to pinned host memory beside Adam's m and v
    S = (P // 4 + 15) // 16 * 16
    assert z["0"]["per_device_bytes"]["master_weights"] == 4 * P
    assert z["1"]["per_device_bytes"]["master_weights"] == z["2"]["per_device_bytes"]["master_weights"] == 4 * S
    off = plan_json("--preset", "qwen2.5-7b", "--precision", "bf16", "--zero", "2", "--devices", 4, "--offload", "cpu")
    d, h = off["per_device_bytes"], off["host_bytes"]
    assert d["optimizer_state"] == 0 and d["master_weights"] == 0
    # ZeRO-2's gradient shard is on the host too: the card keeps the model's gradient windows only
    assert d["gradients"] == g2 - 4 * S
    assert 8 * P <= h["offload"] <= 8 * P + 4 * 64  # 4 ranks' m, v shards (16-element rounding)
    assert h["pinned_shards"] == 4 * (4 * S + 4 * S)  # each rank's fp32 master and gradient shards
    # the card's total and the CPU process agree: + this rank's offloaded m, v, master and gradient shards + the
    # mapped file + its loaded tokenizer (Qwen's, on Qwen's vocabulary) + the runtime + MPI's 8 MiB
    assert h["tokenizer"] == 4 * 33079920
    rest = (off["cpu_rank_bytes"] - d["total"] - h["offload"] // 4 - h["pinned_shards"] // 4 - h["mapped_weights"]
            - h["tokenizer"] // 4 - off["cpu_runtime_bytes"])
    assert abs(rest - (8 << 20)) <= 4 * 64, rest


def test_min_devices_and_power():
    # 7B on 64 GiB cards with offload: the fp16 copy (2 B/param) is on every card at any device count; the
    # gradient shard is what more cards shrink (the master and Adam shards are on the host)
    mem = ("--device-memory", 64)
    p = plan_json("--preset", "qwen2.5-7b", "--precision", "fp16", "--zero", "2", "--offload", "cpu",
                  "--devices", 1, "--checkpointing", *mem)
    n = p["min_devices"]
    assert n > 1
    fits = plan_json("--preset", "qwen2.5-7b", "--precision", "fp16", "--zero", "2", "--offload", "cpu",
                     "--devices", n, "--checkpointing", *mem)
    assert fits["fits"] and fits["per_device_bytes"]["total"] <= 64 * GIB
    short = plan_json("--preset", "qwen2.5-7b", "--precision", "fp16", "--zero", "2", "--offload", "cpu",
                      "--devices", n - 1, "--checkpointing", *mem)
    assert not short["fits"]
    w = fits["power"]
    assert w["total_watts"] == n * 300 + w["hosts"] * 500
    assert abs(w["recommend_watts"] - 1.2 * w["total_watts"]) < 1e-6
    h = fits["host_bytes"]
    assert h["recommend"] >= 1.2 * h["total"] and h["recommend"] % GIB == 0


def test_lora_one_card_and_strategies_table():
    p = plan_json("--preset", "qwen2.5-0.5b", "--mode", "lora", "--lora-r", "8", "--lora-targets", "q,v")
    assert p["n_trainable"] == 540672  # PEFT's count for r=8 on q_proj, v_proj of Qwen2.5-0.5B
    out = qtune("plan", "--preset", "qwen-14b", "--precision", "fp16", "--strategies", check=0).stdout
    for s in ("full/ZeRO0", "ZeRO2+offload", "LoRA 1 card", "56 GB", "35 GB", "20 GB"):
        assert s in out


def test_final_link_counts_no_extra_disk(tmp_path):
    """qtune train writes final/model.safetensors in the model's torch_dtype
    (config.json), whatever the compute precision, and links it to the last
    checkpoint's fp32 file only when that dtype is float32 (trainer_ckpt.c,
    test_final_model_in_another_dtype_is_written). Qwen2.5-0.5B is bfloat16:
    its full fine-tuning in fp32 writes a 2-byte-per-parameter final/ (the plan
    said linked, 0 bytes, so doctor's disk check left it out). A float32
    model's final/ is linked, even when computing in bf16; LoRA writes its adapter."""
    n = plan_json("--preset", "qwen2.5-0.5b", "--mode", "full")["n_params"]
    for prec in ("fp32", "bf16"):
        p = plan_json("--preset", "qwen2.5-0.5b", "--mode", "full", "--precision", prec)
        assert p["final_linked"] is False and p["final_bytes"] == 2 * n, (prec, p)
    assert plan_json("--preset", "qwen2.5-0.5b", "--mode", "lora")["final_linked"] is False
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(cfg(8192, 256, 688, 4, 4, 2)))  # torch_dtype float32
    for prec in ("fp32", "bf16"):
        p = plan_json("--model", m, "--mode", "full", "--precision", prec)
        assert p["final_linked"] is True and p["final_bytes"] == 4 * p["n_params"], (prec, p)


def test_errors():
    p = qtune("plan", "--preset", "qwen2.5-0.5b", "--offload", "cpu")
    assert p.returncode == 2 and "--zero" in p.stderr
    p = qtune("plan", "--preset", "no-such-model")
    assert p.returncode == 1 and "no-such-model" in p.stderr
    p = qtune("plan")
    assert p.returncode == 2
    p = qtune("plan", "--preset", "tiny", "--zero", "4")
    assert p.returncode == 2 and "--zero" in p.stderr
    p = qtune("plan", "--preset", "tiny", "--zero", "2", "--offload-param", "cpu")
    assert p.returncode == 2 and "--offload-param cpu needs --zero 3" in p.stderr


def test_plan_reads_a_job_file(tmp_path):
    """qtune plan JOB.json [--set ...] plans what the job trains: the same JSON as the flags that say it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg(8192, 256, 688, 4, 4, 2)))
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
          "fp16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    job = {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 96},
           "lora": {"r": 4, "target_modules": ["q_proj", "k_proj", "down_proj"], "lora_dropout": 0.1},
           "train": {"gradient_checkpointing": True}, "deepspeed": ds}
    (tmp_path / "job.json").write_text(json.dumps(job))
    got = json.loads(qtune("plan", tmp_path / "job.json", "--devices", 2, "--json", check=0).stdout)
    # micro-batch "auto" with 16 = micro x 4 x 2 ranks -> 2
    want = json.loads(qtune("plan", "--model", tmp_path / "m", "--mode", "lora", "--lora-r", 4, "--lora-targets",
                            "q,k,down", "--zero", 2, "--offload", "cpu", "--precision", "fp16", "--micro-batch", 2,
                            "--seq-len", 96, "--checkpointing", "--devices", 2, "--json", check=0).stdout)
    got.pop("model", None), want.pop("model", None)
    assert got == want
    # --set reaches the job (and its deepspeed section); an option beside the job overrides it
    got = json.loads(qtune("plan", tmp_path / "job.json", "--set", "data.seq_len=128", "--set", "lora.r=16",
                           "--devices", 2, "--micro-batch", 1, "--json", check=0).stdout)
    want = json.loads(qtune("plan", "--model", tmp_path / "m", "--mode", "lora", "--lora-r", 16, "--lora-targets",
                            "q,k,down", "--zero", 2, "--offload", "cpu", "--precision", "fp16", "--micro-batch", 1,
                            "--seq-len", 128, "--checkpointing", "--devices", 2, "--json", check=0).stdout)
    got.pop("model", None), want.pop("model", None)
    assert got == want
    p = qtune("plan", "--set", "lora.r=4", "--preset", "qwen2.5-0.5b")
    assert p.returncode == 2 and "needs a job file" in p.stderr
    # a --set with nothing after it was passed over in silence
    p = qtune("plan", tmp_path / "job.json", "--devices", 2, "--set")
    assert p.returncode == 2 and "--set needs a value" in p.stderr, p.stderr


def test_plan_finds_the_job_file_after_a_flag(tmp_path):
    """A job file may follow any option that takes no value, --overlap-comm included (it was taken for an
    unknown option there, while --checkpointing, --strategies and --json worked)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg(8192, 256, 688, 4, 4, 2)))
    job = {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 64},
           "deepspeed": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    want = plan_json(tmp_path / "job.json", "--devices", 2, "--overlap-comm")
    for flag in ("--overlap-comm", "--checkpointing", "--strategies", "--json"):
        p = qtune("plan", flag, tmp_path / "job.json", "--devices", 2, "--overlap-comm", "--json")
        assert p.returncode == 0, (flag, p.stderr)
        got = json.loads(p.stdout)
        if flag == "--checkpointing":
            assert got != want
        else:
            assert got == want


def test_plan_reads_the_jobs_zero_buckets(tmp_path):
    """zero_optimization's reduce_bucket_size, allgather_bucket_size and overlap_comm size the gradient windows
    and the communication buffers of the run; a job's plan takes them as --reduce-bucket-size,
    --allgather-bucket-size and --overlap-comm do (it used to plan DeepSpeed's 5e8 defaults whatever the job
    said: 2 ranks of a 28M-parameter model planned at 666 MiB a rank against a measured 495)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg(8192, 256, 688, 4, 4, 2)))
    zero = {"stage": 2, "reduce_bucket_size": 100000, "allgather_bucket_size": 200000, "overlap_comm": True}
    job = {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 64},
           "deepspeed": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    got = plan_json(tmp_path / "job.json", "--devices", 2)
    want = plan_json("--model", tmp_path / "m", "--zero", 2, "--micro-batch", 2, "--seq-len", 64, "--devices", 2,
                     "--reduce-bucket-size", 100000, "--allgather-bucket-size", 200000, "--overlap-comm")
    got.pop("model", None), want.pop("model", None)
    assert got == want
    default = plan_json("--model", tmp_path / "m", "--zero", 2, "--micro-batch", 2, "--seq-len", 64, "--devices", 2)
    assert got["per_device_bytes"]["communication"] < default["per_device_bytes"]["communication"]


def test_plan_counts_modules_to_save(tmp_path):
    """lora.modules_to_save in a job plans like --modules-to-save: the embedding and lm_head (two copies on a
    tied model) are trainable parameters, and their gradients and Adam state are ZeRO-sharded."""
    (tmp_path / "m").mkdir()
    c = cfg(8192, 256, 688, 4, 4, 2)
    (tmp_path / "m" / "config.json").write_text(json.dumps(c))
    job = {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 64},
           "lora": {"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["embed_tokens", "lm_head"],
                    "lora_dropout": 0.1},
           "deepspeed": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    got = plan_json(tmp_path / "job.json", "--devices", 2)
    want = plan_json("--model", tmp_path / "m", "--mode", "lora", "--lora-r", 4, "--lora-targets", "q",
                     "--modules-to-save", "embed_tokens,lm_head", "--zero", 2, "--seq-len", 64, "--devices", 2)
    got.pop("model", None), want.pop("model", None)
    assert got == want and got["modules_to_save"] == "embed_tokens,lm_head"
    plain = plan_json("--model", tmp_path / "m", "--mode", "lora", "--lora-r", 4, "--lora-targets", "q",
                      "--zero", 2, "--seq-len", 64, "--devices", 2)
    VC = c["vocab_size"] * c["hidden_size"]
    assert got["n_trainable"] == plain["n_trainable"] + 2 * VC
    assert got["checkpoint_bytes"] > plain["checkpoint_bytes"] + 2 * VC * 4  # weights + Adam's m, v
    p = qtune("plan", "--preset", "tiny", "--mode", "lora", "--modules-to-save", "norm")
    assert p.returncode == 2 and "--modules-to-save names 'norm'" in p.stderr


def test_plan_takes_layers_to_transform_and_dropout(tmp_path):
    """A job's plan counts LoRA in the layers lora.layers_to_transform keeps, as the run adapts them, and the
    dropout input buffer only when the job's lora_dropout is above 0 (the plan counted every layer and a
    dropout of 0.1 whatever the job said, issue 40). Its trainable count is the run's."""
    c = cfg(8192, 256, 688, 4, 4, 2)
    (tmp_path / "config.json").write_text(json.dumps(c))
    qtune("init", "--out", tmp_path / "m", "--config", tmp_path / "config.json", "--seed", 1, check=0)
    B, T, R, C = 2, 32, 4, c["hidden_size"]
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"input_ids": [(7 * i + k) % 8000 + 1 for k in range(T + 1)]}) + "\n")
    lora = {"r": R, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    job = {"model": "m", "output_dir": "out", "data": {"train": "train.jsonl", "seq_len": T, "packing": False},
           "train": {"max_steps": 1, "save_steps": 0, "seed": 1},
           "deepspeed": {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1}, "lora": lora}

    def plan(**over):
        j = json.loads(json.dumps(job))
        j["lora"].update(over)
        (tmp_path / "job.json").write_text(json.dumps(j))
        return plan_json(tmp_path / "job.json")

    every = plan()
    half = plan(layers_to_transform=[0, 2])
    H, KV, D = c["num_attention_heads"], c["num_key_value_heads"], C // c["num_attention_heads"]
    per_layer = R * (C + H * D) + R * (C + KV * D)  # q_proj and v_proj's A and B
    assert every["n_trainable"] == 4 * per_layer, every
    assert half["n_trainable"] == 2 * per_layer, half
    assert half["per_device_bytes"]["total"] < every["per_device_bytes"]["total"]
    assert every["lora_layers"] == 4 and half["lora_layers"] == 2
    # the run adapts the same parameters
    p = qtune("train", tmp_path / "job.json", check=0, env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    m = re.search(r"(\d+) trainable parameters", p.stderr)
    assert m and int(m.group(1)) == half["n_trainable"], p.stderr
    # dropout: the model's buffer for a linear's dropped input, B x T x the widest input (here I) floats
    dropped = plan(lora_dropout=0.1)
    assert dropped["lora_dropout"] == 0.1 and every["lora_dropout"] == 0
    widest = max(C, c["intermediate_size"], H * D)
    assert dropped["per_device_bytes"]["total"] - every["per_device_bytes"]["total"] == B * T * widest * 4
    # a layer the model does not have: the plan refuses it as the run does
    (tmp_path / "job.json").write_text(json.dumps(dict(job, lora=dict(lora, layers_to_transform=[7]))))
    p = qtune("plan", tmp_path / "job.json")
    assert p.returncode != 0 and "layers_to_transform" in p.stderr, p.stderr


@pytest.mark.parametrize("opt,hi", [("--micro-batch", 1 << 20), ("--seq-len", 1 << 22), ("--lora-r", 65536),
                                    ("--cards-per-host", 4096)])
def test_a_count_past_its_limit_is_refused_with_the_range(opt, hi):
    """A count above its limit is refused naming the range (it said 'must be a positive whole number' of a
    positive whole number); the limit itself is taken."""
    qtune("plan", "--preset", "tiny", opt, hi, "--json", check=0)
    for bad in (hi + 1, 0, "x"):
        p = qtune("plan", "--preset", "tiny", opt, bad, check=2)
        assert f"{opt} must be a whole number from 1 to {hi}, not '{bad}'" in p.stderr, p.stderr


def test_lora_targets_are_resolved_against_the_models_layout():
    """--lora-targets on the original Qwen (one fused c_attn): "v" or "k,v" planned 0 trainable parameters
    without a word, c_attn (a job's name for it) was refused and q_proj (which a run refuses) accepted. The
    names now resolve as a run resolves target_modules."""
    for bad in ("v", "k,v", "q_proj"):
        p = qtune("plan", "--preset", "qwen-14b", "--mode", "lora", "--lora-targets", bad)
        assert p.returncode == 2 and "c_attn" in p.stderr and "QWenLMHeadModel" in p.stderr, (bad, p.stderr)
    c_attn = plan_json("--preset", "qwen-14b", "--mode", "lora", "--lora-targets", "c_attn")
    assert c_attn["n_trainable"] == plan_json("--preset", "qwen-14b", "--mode", "lora")["n_trainable"] > 0
    # r (8) x (C + 3C) per layer, 40 layers: c_attn's A (8, 5120) and B (15360, 8)
    assert c_attn["n_trainable"] == 40 * 8 * (5120 + 3 * 5120)
    p = qtune("plan", "--preset", "qwen2.5-0.5b", "--mode", "lora", "--lora-targets", "q,bogus")
    assert p.returncode == 2 and "'bogus'" in p.stderr, p.stderr
    assert plan_json("--preset", "qwen2.5-0.5b", "--mode", "lora", "--lora-targets", "q,v") == \
        plan_json("--preset", "qwen2.5-0.5b", "--mode", "lora", "--lora-targets", "q_proj,v_proj")


def test_a_jobs_lora_targets_are_resolved_against_the_model(tmp_path):
    """A job's target_modules went to the plan by name alone: ["v_proj"] on the original Qwen planned 0
    trainable parameters with exit 0, where train and doctor refuse the job. They resolve as a run resolves
    them now, and the plan names the adapted modules in the layout's own names (c_attn, not q_proj,v_proj)."""
    qtune("init", "--out", tmp_path / "m", "--preset", "tiny-qwen", "--seed", "1")
    job = {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 64},
           "lora": {"r": 4, "target_modules": ["v_proj"]}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    p = qtune("plan", tmp_path / "job.json")
    assert p.returncode == 1 and "c_attn" in p.stderr and "v_proj" in p.stderr, p.stderr
    job["lora"].pop("target_modules")  # PEFT's default for model_type qwen: c_attn
    (tmp_path / "job.json").write_text(json.dumps(job))
    got = plan_json(tmp_path / "job.json")
    assert got["lora_targets"] == "c_attn" and got["n_trainable"] == 2 * 4 * (64 + 3 * 64), got


def test_plan_zero3_recipe_and_large_models():
    """ZeRO-3's per-card figures of docs/plan.md: the recipe (Qwen-14B fp16, 4 cards) drops from 31.0 GiB at
    stage 2 to 13.7, Qwen2.5-32B fits 4 cards and 72B 8 (or 4 with offload_param); the weights line is the
    rank's 2-byte shard, two layers and the V x C buffer."""
    def plan(preset, n, zero, *extra):
        p = qtune("plan", "--preset", preset, "--precision", "fp16", "--micro-batch", "2", "--seq-len", "512",
                  "--checkpointing", "--reduce-bucket-size", "26214400", "--allgather-bucket-size", "26214400",
                  "--device", "cuda", "--devices", n, "--offload", "cpu", "--zero", zero, *extra, "--json")
        assert p.returncode == 0, p.stderr
        j = json.loads(p.stdout)
        return j["per_device_bytes"]["total"] / 2**30, j["per_device_bytes"]["weights"] / 2**30, j["fits"]
    t2, w2, _ = plan("qwen-14b", 4, 2)
    t3, w3, fits = plan("qwen-14b", 4, 3)
    assert abs(t2 - 31.0) < 0.05 and abs(t3 - 13.7) < 0.05 and fits, (t2, t3)
    # 14.17e9 params / 4 x 2 bytes + (2 layers + V x C) x 2 bytes + the norms in fp32
    assert abs(w3 - 9.23) < 0.01 and abs(w2 - 26.39) < 0.01, (w2, w3)
    assert plan("qwen-14b", 4, 3, "--offload-param", "cpu")[1] < 3
    assert plan("qwen2.5-32b", 4, 3)[2] and not plan("qwen2.5-32b", 4, 2)[2]
    assert plan("qwen2.5-72b", 8, 3)[2] and not plan("qwen2.5-72b", 4, 3)[2]
    assert plan("qwen2.5-72b", 4, 3, "--offload-param", "cpu")[2]
    # LoRA at stage 3: the frozen base 1/N a rank (the adapter whole); QLoRA is refused, naming stage 2
    def lora_weights(zero, n):
        p = qtune("plan", "--preset", "qwen-14b", "--zero", str(zero), "--devices", str(n), "--mode", "lora",
                  "--precision", "bf16", "--json")
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["per_device_bytes"]["weights"] / 2**30
    # stage 2: the whole base in bf16 (26.39 GiB); stage 3: the same 1/4 + two layers + V x C as full
    # fine-tuning's 9.23 (the adapter, whole on every rank, is 0.01 GiB of it in fp32)
    lw2, lw3 = lora_weights(2, 4), lora_weights(3, 4)
    assert abs(lw2 - w2) < 0.05 and abs(lw3 - w3) < 0.05, (lw2, lw3)
    p = qtune("plan", "--preset", "tiny", "--zero", "3", "--devices", "2", "--mode", "lora", "--quantization", "nf4")
    assert p.returncode != 0 and "does not partition a 4-bit (QLoRA) base" in p.stderr, p.stderr


def test_plan_zero3_reuse_distance():
    """stage3_max_reuse_distance (--max-reuse-distance): the plan says what it made of the V x C buffer. At
    Qwen2.5-0.5B's shape (4 ranks, fp16, buckets of 1.5e7: bench/RESULTS-zero.md) the layers read 3.58e8
    parameters between its uses: DeepSpeed's 1e9 keeps it, 1e8 frees it between uses but the lm_head's backward
    still holds it whole with the reductions (the same peak), and 0 reads that backward a vocabulary slice at a
    time: the 259.7 MiB buffer and the 3 x 57 MiB reduce temporaries are never held together."""
    base = ["--preset", "qwen2.5-0.5b", "--zero", "3", "--devices", "4", "--precision", "fp16", "--micro-batch",
            "1", "--seq-len", "64", "--overlap-comm", "--reduce-bucket-size", "1.5e7", "--allgather-bucket-size",
            "1.5e7", "--device", "cpu"]
    j = {d: plan_json(*base, "--max-reuse-distance", d) for d in ("1e9", "1e8", "0")}
    assert plan_json(*base)["cpu_rank_bytes"] == j["1e9"]["cpu_rank_bytes"]  # the default
    assert "stays gathered between its uses: the layers read 3.58e+08 parameters" in j["1e9"]["stage3_reuse"]
    assert "is freed after the lookup and after the lm_head's backward" in j["1e8"]["stage3_reuse"]
    assert j["1e8"]["cpu_rank_bytes"] == j["1e9"]["cpu_rank_bytes"]
    assert "one vocabulary slice (31.5 MiB) at a time" in j["0"]["stage3_reuse"], j["0"]["stage3_reuse"]
    less = j["1e9"]["cpu_rank_bytes"] - j["0"]["cpu_rank_bytes"]
    assert less == j["1e9"]["per_device_bytes"]["weights"] - j["0"]["per_device_bytes"]["weights"]
    assert abs(less / 2 ** 20 - 140.2) < 0.1, less / 2 ** 20
    # the text report says it once; stage 2 has no such line; a negative distance is refused
    text = qtune("plan", *base, "--max-reuse-distance", "0", check=0).stdout
    assert text.count("stage3_max_reuse_distance 0:") == 1, text
    assert "stage3_max_reuse_distance" not in qtune("plan", *base[:2], "--zero", "2", "--devices", "4",
                                                    check=0).stdout
    p = qtune("plan", *base, "--max-reuse-distance", "-1")
    assert p.returncode == 2 and "--max-reuse-distance must be a number of parameters >= 0" in p.stderr
