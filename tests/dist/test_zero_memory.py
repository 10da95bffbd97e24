"""The plan is the allocation: `qtune plan`'s cpu_rank_bytes_per_rank against the peak RSS every rank of
`qtune train` reports (metrics.jsonl mem_peak_bytes_ranks), under real mpirun at 1, 2 and 4 ranks, ZeRO
stages 0, 1, 2 and 3, optimizer (and at stage 3 parameter) offload on and off, full fine-tuning and LoRA: within 10% on every rank.
Both sides size the model's blocks with memplan (gradient windows at ZeRO-2 over several ranks) and the
ZeRO buffers with dist.h zero_memory."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import trainutil as u  # noqa: E402

MPIRUN = shutil.which("mpirun")
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]
B, T = 2, 64


def built_with_mpi():
    cfg = os.path.join(os.environ.get("QTUNE_BUILD_DIR", ""), "generated", "qtune_config.h")
    try:
        with open(cfg) as f:
            return "#define QTUNE_HAVE_MPI 1" in f.read()
    except OSError:
        return True


pytestmark = [
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (apt-get install openmpi-bin)"),
    pytest.mark.skipif(not built_with_mpi(), reason="this build has no MPI (QTUNE_HAVE_MPI 0)"),
    pytest.mark.skipif(not os.path.exists(u.QTUNE), reason=f"{u.QTUNE} not built"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero_mem")
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 8192, "hidden_size": 256,
           "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False}
    (d / "config.json").write_text(json.dumps(cfg))
    u.run("init", "--out", str(d / "m"), "--config", str(d / "config.json"), "--seed", "1")
    rng = np.random.default_rng(0)
    with open(d / "train.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"input_ids": [int(x) for x in rng.integers(1, 8190, T + 1)]}) + "\n")
    return d


CASES = [(1, 0, 0), (1, 1, 1), (1, 2, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1), (2, 2, 0), (2, 2, 1),
         (4, 0, 0), (4, 1, 1), (4, 2, 0), (4, 2, 1)]


# ZeRO-2's gradient buckets (reduce_bucket_size; the layers here are 0.73M elements, 2.9M in all): finer
# than a layer (1e5: each MLP matrix of 176K its own bucket), spanning layers (1e6), and one window without
# overlap_comm; the plan follows the same packing (memplan.h qt_grad_pack) as the allocation.
BUCKET_CASES = [(2, 1e5, True), (2, 1e6, False), (4, 1e5, False), (4, 1e6, True), (2, None, False)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("n,stage,offload", CASES)
def test_plan_matches_every_rank(setup, n, stage, offload, lora):
    check_plan(setup, n, stage, offload, lora, None, True)


@pytest.mark.parametrize("n,bucket,overlap", BUCKET_CASES)
def test_plan_matches_every_rank_buckets(setup, n, bucket, overlap):
    check_plan(setup, n, 2, 1, False, bucket, overlap)


# fp16/bf16 full fine-tuning: ZeRO 1/2 over N ranks keep each rank's shard of the fp32 master (on the host with
# offload) beside the whole 2-byte compute copy; here the master is 20 MiB, so a rank holding all of it at 4
# ranks would be 15 MiB (about 15%) over the plan
@pytest.mark.parametrize("prec", ["fp16", "bf16"])
@pytest.mark.parametrize("n,stage,offload", [(2, 0, 0), (2, 2, 0), (4, 1, 1), (4, 2, 1)])
def test_plan_matches_every_rank_16bit(setup, n, stage, offload, prec):
    check_plan(setup, n, stage, offload, False, None, True, prec)


# ZeRO-3: each rank keeps its shard of the compute weights (in f32 the master shard), on the host with
# offload_param, and three gather buffers (two layers, the embedding); the norm weights and biases whole
@pytest.mark.parametrize("prec", [None, "fp16", "bf16"])
@pytest.mark.parametrize("n,offload,offload_param", [(2, 0, 0), (4, 1, 1), (4, 0, 0)])
def test_plan_matches_every_rank_stage3(setup, n, offload, offload_param, prec):
    check_plan(setup, n, 3, offload, False, None, True, prec, offload_param)


# LoRA at ZeRO-3: each rank keeps its shard of the frozen base's matrices (the embedding is 2M of the 2.9M
# elements here; in f32 the file's dtype, on the host with offload_param) and the three gather buffers; the
# adapter whole. At stage 2 every rank maps the whole base.
@pytest.mark.parametrize("prec", [None, "bf16"])
@pytest.mark.parametrize("n,offload,offload_param", [(2, 0, 0), (4, 1, 1)])
def test_plan_matches_every_rank_stage3_lora(setup, n, offload, offload_param, prec):
    check_plan(setup, n, 3, offload, True, None, True, prec, offload_param)


# ZeRO-3 with stage3_max_reuse_distance below the layers' 0.8M parameters: the embedding's V x C buffer freed
# between uses (1e5), at 0 the lm_head's backward reading it a slice at a time (3 slices of the layers' bucket);
# here every buffer is below glibc's 32 MiB mmap ceiling, so the plan counts them all (what a freed block may
# leave in the heap). The peak's fall where they are larger: bench/RESULTS-zero.md (Qwen2.5-0.5B, 4 ranks).
@pytest.mark.parametrize("n,prec,reuse,lora", [(2, None, 0, False), (4, "fp16", 0, False), (4, "bf16", 1e5, False),
                                               (4, None, 0, True)])
def test_plan_matches_every_rank_stage3_reuse(setup, n, prec, reuse, lora):
    check_plan(setup, n, 3, 0, lora, None, True, prec, 0, reuse)


def check_plan(d, n, stage, offload, lora, bucket, overlap, prec=None, offload_param=0, reuse=None):
    name = (f"n{n}_s{stage}_o{offload}{offload_param}_{'lora' if lora else 'full'}_b{bucket}_ov{int(overlap)}_"
            f"{prec or 'fp32'}" + (f"_rd{reuse:g}" if reuse is not None else ""))
    z = {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}, "overlap_comm": overlap}
    if offload_param:
        z["offload_param"] = {"device": "cpu"}
    if bucket:
        z["reduce_bucket_size"] = bucket
    if reuse is not None:
        z["stage3_max_reuse_distance"] = reuse
    job = {"model": "m", "output_dir": name,
           "data": {"train": "train.jsonl", "seq_len": T, "packing": False, "shuffle": False},
           "train": {"max_steps": 2, "log_steps": 1, "seed": 1, "save_steps": 0},
           "deepspeed": {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                         "zero_optimization": z}}
    if prec:
        job["deepspeed"][prec] = {"enabled": True}
    if lora:
        job["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    (d / f"{name}.json").write_text(json.dumps(job))
    env = u.env()
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    cmd = ([MPIRUN, *MPI_ARGS, "-np", str(n)] if n > 1 else []) + [u.QTUNE, "train", str(d / f"{name}.json")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(d / name / "metrics.jsonl") as f:
        last = [json.loads(l) for l in f if l.strip() and "step" in l][-1]
    measured = last.get("mem_peak_bytes_ranks", [last["mem_peak_bytes"]])
    assert len(measured) == n
    args = ["plan", "--model", str(d / "m"), "--micro-batch", B, "--seq-len", T, "--json", "--zero", stage,
            "--devices", n]
    if overlap:
        args += ["--overlap-comm"]
    if bucket:
        args += ["--reduce-bucket-size", bucket]
    if offload:
        args += ["--offload", "cpu"]
    if offload_param:
        args += ["--offload-param", "cpu"]
    if reuse is not None:
        args += ["--max-reuse-distance", reuse]
    if prec:
        args += ["--precision", prec]
    if lora:
        args += ["--mode", "lora", "--lora-r", 8, "--lora-targets", "q_proj,v_proj"]
    plan = json.loads(u.run(*map(str, args)).stdout)
    predicted = plan["cpu_rank_bytes_per_rank"]
    errs = [(pr - m) / m for pr, m in zip(predicted, measured)]
    print(name, " ".join(f"r{r}: plan {pr / 2**20:.1f} MiB, peak {m / 2**20:.1f} MiB ({e:+.1%})"
                         for r, (pr, m, e) in enumerate(zip(predicted, measured, errs))))
    # 10%; 12% at 4 ranks, where the pages of OpenMPI's shared-memory transport a rank touches depend on how
    # far the ranks drift apart on 2 cores: under load one rank of four peaked 7-8 MiB above the others
    # (-10.0% and -11.8% on 2026-12-06, Intel Xeon; the same cases at -6% run alone, on 180687f as well)
    tol = 0.12 if n >= 4 else 0.10
    assert all(abs(e) <= tol for e in errs), (name, predicted, measured, errs)


def test_peak_is_the_runs_own_when_its_parent_is_large(setup):
    """mem_peak_bytes is the run's own high-water mark (VmHWM), not getrusage's ru_maxrss, which Linux
    carries across execve: started from this Python process holding 640 MiB more, 7ffe4f9 reported the
    parent's size as the run's peak (-85% against the plan seen when a torch-importing test ran first)."""
    ballast = b"\1" * (640 << 20)  # touched pages: this process's RSS grows by 640 MiB before the fork
    try:
        check_plan(setup, 1, 0, 0, False, None, True)
    finally:
        del ballast
