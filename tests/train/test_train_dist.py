"""Two MPI ranks with ZeRO-2 train the same model as one rank with twice the
accumulation (DESIGN: N ranks x A == 1 rank x N*A, up to rounding), and the
training step's collectives (token count, loss, gradients, all-gather) agree."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from trainutil import QTUNE, env, init_model, optimizer_state, run, st, step_lines, write_job, write_tokens


def mpi_ok():
    if not shutil.which("mpirun"):
        return False
    cfg = os.path.join(os.environ.get("QTUNE_BUILD_DIR", ""), "generated", "qtune_config.h")
    return not os.path.exists(cfg) or "QTUNE_HAVE_MPI 1" in open(cfg).read()


@pytest.mark.skipif(not mpi_ok(), reason="needs mpirun and a qtune built with MPI")
@pytest.mark.parametrize("stage", [0, 2])
def test_two_ranks_equal_one_rank_with_double_accumulation(tmp_path, stage):
    d = str(tmp_path)
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 32, 16, seed=4, min_len=5)
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
          "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    job = write_job(os.path.join(d, "job.json"), "model", "out2", "train.jsonl", ds=ds,
                    train_opts={"max_steps": 6, "save_steps": 3})
    e = env()
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job],
                       capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    run("train", job, "--set", "output_dir=out1")
    m2, m1 = step_lines(os.path.join(d, "out2")), step_lines(os.path.join(d, "out1"))
    assert len(m2) == len(m1) == 6
    for a, b in zip(m2, m1):
        assert a["tokens"] == b["tokens"] == 8 * 16
        # stage 2 shards Adam's m and v: rank 0 holds about half of what one rank holds
        if stage == 2:
            assert a["opt_state_bytes"] < 0.6 * b["opt_state_bytes"]
        else:
            assert a["opt_state_bytes"] == b["opt_state_bytes"]
        assert a["comm_s"] >= 0 and b["comm_s"] >= 0
        assert a["target_tokens"] == b["target_tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a, b)
    w2 = st.read(os.path.join(d, "out2", "final", "model.safetensors"))
    w1 = st.read(os.path.join(d, "out1", "final", "model.safetensors"))
    for k in w1:
        # k_proj's bias has an exactly-zero gradient in exact arithmetic (it adds
        # the same q.b to every score of a row); Adam turns its rounding noise
        # into full-size steps of either sign, so it is compared loosely
        # Others: 6 Adam steps at lr 2e-3 amplify the two runs' different
        # summation orders (stage 2 reduces per layer, one rank sums the whole
        # batch) to about 1e-5 absolute on weights of 0.01-0.1: measured up to
        # 1.2e-5 (o_proj) after the RoPE table moved to rope_utils' double
        # formula, with losses equal within 1e-5 and grad norms within 1e-4
        tol = 6 * 2e-3 if k.endswith("k_proj.bias") else 3e-5
        assert np.allclose(w2[k], w1[k], rtol=1e-4, atol=tol), k
    # each rank wrote its ZeRO shard (stage 2: two parts; stage 0: rank 0 writes the one part)
    ck2 = os.path.join(d, "out2", "checkpoint-6")
    parts = sorted(f for f in os.listdir(ck2) if f.startswith("optimizer"))
    assert parts == (["optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"] if stage == 2
                     else ["optimizer-00000-of-00001.safetensors"]), parts
    o2 = optimizer_state(ck2)
    o1 = optimizer_state(os.path.join(d, "out1", "checkpoint-6"))
    assert np.allclose(o2["exp_avg"], o1["exp_avg"], rtol=1e-3, atol=1e-7)
    assert json.load(open(os.path.join(d, "out2", "checkpoint-6", "trainer_state.json")))["world"] == 2


@pytest.mark.skipif(not mpi_ok(), reason="needs mpirun and a qtune built with MPI")
@pytest.mark.parametrize("save,layers,bucket", [(["embed_tokens", "lm_head"], [1], None), (["lm_head"], None, None),
                                                 (["embed_tokens", "lm_head"], [1], 300)])
def test_two_ranks_zero2_modules_to_save(tmp_path, save, layers, bucket):
    """LoRA with modules_to_save (and layers_to_transform) at ZeRO-2 over two ranks: the saved embedding's
    rows, the lm_head's vocabulary slices and the adapted layers' gradient buckets (DeepSpeed's default
    reduce_bucket_size, or 300 elements with overlap_comm: a bucket per module, two windows) are partitioned
    like full fine-tuning's, and the run equals one rank with twice the accumulation."""
    d = str(tmp_path)
    init_model(os.path.join(d, "model"))  # tiny: tied embeddings, so each saved module is its own copy
    write_tokens(os.path.join(d, "train.jsonl"), 32, 16, seed=4, min_len=5)
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 2}}
    if bucket:
        ds["zero_optimization"].update(reduce_bucket_size=bucket, overlap_comm=True)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": save,
            "layers_to_transform": layers}
    job = write_job(os.path.join(d, "job.json"), "model", "out2", "train.jsonl", ds=ds, lora=lora,
                    train_opts={"max_steps": 4})
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    run("train", job, "--set", "output_dir=out1")
    m2, m1 = step_lines(os.path.join(d, "out2")), step_lines(os.path.join(d, "out1"))
    assert len(m2) == len(m1) == 4
    for a, b in zip(m2, m1):
        assert a["opt_state_bytes"] < 0.6 * b["opt_state_bytes"]  # the saved modules' Adam state is sharded
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a, b)
    w2 = st.read(os.path.join(d, "out2", "final", "adapter_model.safetensors"))
    w1 = st.read(os.path.join(d, "out1", "final", "adapter_model.safetensors"))
    assert set(w2) == set(w1) and "base_model.model.lm_head.weight" in w1
    for k in w1:
        assert np.allclose(w2[k], w1[k], rtol=1e-4, atol=3e-5), k
