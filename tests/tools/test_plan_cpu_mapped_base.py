"""qtune plan's CPU figure (cpu_rank_bytes) for LoRA on a bf16 model folder trained in bf16, the recipe's
case (Qwen's folders are bfloat16): the frozen base is then read where it lies in the file mapping, no
converted copy is made, and those pages are in the process's resident size. The plan counted them only in
fp32, so a QLoRA run of Qwen-14B's shape measured 1.45 GiB (its untied lm_head) above the plan
(bench/RESULTS-qlora-14b.md). An untied embedding table is read a row a token, so only the rows of a
micro-batch count. Measured here on an untied bf16 shape, with and without a 4-bit base, in bf16 and fp32."""
import json

import numpy as np
import pytest

from conftest import qtune


@pytest.mark.parametrize("prec,quant", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_cpu_plan_counts_the_mapped_bf16_base(tmp_path, prec, quant):
    V, C, B, T = 16384, 384, 2, 64
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": V, "hidden_size": C,
           "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
           "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    qtune("init", "--out", tmp_path / "m", "--config", tmp_path / "config.json", "--dtype", "bf16", check=0)
    rng = np.random.default_rng(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(2 * B):
            f.write(json.dumps({"input_ids": [int(x) for x in rng.integers(1, V - 1, T + 1)]}) + "\n")
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1}
    if prec == "bf16":
        ds["bf16"] = {"enabled": True}
    job = {"model": "m", "output_dir": "out", "device": "cpu",
           "data": {"train": "train.jsonl", "seq_len": T, "packing": False, "shuffle": False},
           "lora": {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
           "train": {"max_steps": 2, "log_steps": 1, "seed": 1, "gradient_checkpointing": True},
           "deepspeed": ds}
    if quant:
        job["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    (tmp_path / "job.json").write_text(json.dumps(job))
    qtune("train", tmp_path / "job.json", check=0, env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        measured = max(json.loads(l).get("mem_peak_bytes", 0) for l in f if l.strip())
    plan = json.loads(qtune("plan", tmp_path / "job.json", "--device", "cpu", "--json", check=0).stdout)
    predicted = plan["cpu_rank_bytes"]
    err = (predicted - measured) / measured
    print(f"{prec} quant={quant}: cpu plan {predicted / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB "
          f"({err:+.1%})")
    assert abs(err) <= 0.10, f"plan {predicted} vs measured {measured} ({err:+.1%})\n{plan}"
