"""ZeRO-3 under real mpirun: the weights the graph reads are partitioned too,
each layer's gathered before its forward and again before its backward.

The gathers move bits (each owner broadcasts its part), the gradients take
stage 2's path and the optimizer updates the same shard, so N ranks at stage
3 equal N ranks at stage 2 bit for bit (losses, grad norms, final weights),
with and without prefetch, in fp32, fp16 and bf16; stage 2's own tests hold
it against 1 rank with N-fold accumulation, and so does this file within
their tolerances. Checkpoints hold each rank's shard (the sharded-master
format) and resume bit for bit at the same rank count and at another one."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_train_mpi import (LR, STEPS, built_with_mpi, mpirun, MPIRUN, weights)  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import trainutil as u  # noqa: E402
import st  # noqa: E402

pytestmark = [
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (apt-get install openmpi-bin)"),
    pytest.mark.skipif(not built_with_mpi(), reason="this build has no MPI (QTUNE_HAVE_MPI 0)"),
    pytest.mark.skipif(not os.path.exists(u.QTUNE), reason=f"{u.QTUNE} not built"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for preset in ("tiny", "tiny-qwen3", "tiny-qwen"):
        d = tmp_path_factory.mktemp("z3_" + preset.replace("-", "_"))
        u.init_model(str(d / "model"), preset=preset, seed=5)
        u.write_tokens(str(d / "train.jsonl"), 64, 16, 1)
        out[preset] = d
    return out


def job(d, name, accum, zero, prec=None, steps=STEPS, train_opts=None, eval_data=False):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}
    if prec:
        ds[prec] = {"enabled": True}
    opts = dict({"max_steps": steps}, **(train_opts or {}))
    path = u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", T=16, train_opts=opts, ds=ds)
    return path


def run_ok(n, args):
    rc, out = mpirun(n, args)
    assert rc == 0, out
    return out


def steps_of(d, name):
    return [(s["loss"], s["grad_norm"]) for s in u.step_lines(str(d / name))]


def same(d, a, b):
    assert steps_of(d, a) == steps_of(d, b)
    wa, wb = weights(str(d / a)), weights(str(d / b))
    assert set(wa) == set(wb)
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), k


Z2 = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 3000}


@pytest.mark.parametrize("preset,n,prec,ckpt", [("tiny", 2, None, False), ("tiny", 3, "fp16", False),
                                                ("tiny", 4, "bf16", False), ("tiny", 4, None, True),
                                                ("tiny-qwen3", 2, "fp16", True), ("tiny-qwen", 3, None, False),
                                                ("tiny-qwen", 2, "bf16", True)])
def test_stage3_equals_stage2_bit_for_bit(models, preset, n, prec, ckpt):
    """tiny-qwen has an untied lm_head (the V x C buffer alternates between the embedding and the lm_head);
    with gradient checkpointing each layer's recompute reads the buffer its backward gathered."""
    d = models[preset]
    tag = f"{n}_{prec}_{int(ckpt)}"
    topts = {"gradient_checkpointing": ckpt}
    run_ok(n, ["train", job(d, f"s2_{tag}", 1, Z2, prec, train_opts=topts)])
    # prefetch on (DeepSpeed's default bucket) and off (0), persistence threshold 0: every matrix partitioned
    for pf in (5e7, 0):
        z3 = dict(Z2, stage=3, stage3_prefetch_bucket_size=pf, stage3_param_persistence_threshold=0)
        name = f"s3_{tag}_{int(pf)}"
        out = run_ok(n, ["train", job(d, name, 1, z3, prec, train_opts=topts)])
        assert "ZeRO stage 3" in out, out
        same(d, f"s2_{tag}", name)


@pytest.mark.parametrize("preset,n,prec,ckpt,accum", [("tiny", 2, "fp16", False, 2), ("tiny", 4, "bf16", True, 1),
                                                      ("tiny-qwen", 3, None, False, 2),
                                                      ("tiny-qwen3", 2, "bf16", False, 1)])
def test_stage3_reuse_distance_frees_the_vocabulary_buffer_bit_for_bit(models, preset, n, prec, ckpt, accum):
    """stage3_max_reuse_distance below the layers' parameters: the V x C buffer is freed after the lookup and
    after the lm_head's backward and gathered again (1000 here); at 0 also between the lm_head's forward and
    its backward, which then gathers it a vocabulary slice at a time (reduce_bucket_size 3000: many slices).
    Either way stage 2's bits, with accumulation (the buffer freed between micro-batches), checkpointing, an
    untied lm_head (tiny-qwen) and eval passes between steps; the run says what the key made of it."""
    d = models[preset]
    u.write_tokens(str(d / "eval_r.jsonl"), 4, 16, 3)
    tag = f"{preset}_{n}_{prec}_{int(ckpt)}_{accum}"
    topts = {"gradient_checkpointing": ckpt, "eval_steps": 2}
    def reuse_job(name, z):
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": z}
        if prec:
            ds[prec] = {"enabled": True}
        return u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", eval_="eval_r.jsonl", T=16,
                           train_opts=dict({"max_steps": STEPS}, **topts), ds=ds)
    run_ok(n, ["train", reuse_job(f"r2_{tag}", Z2)])
    said = {1000: "is freed after the lookup and after the lm_head's backward",
            0: "the lm_head's backward gathers it one vocabulary slice"}
    for dist in (1000, 0):
        z3 = dict(Z2, stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=dist)
        name = f"r3_{tag}_{dist}"
        out = run_ok(n, ["train", reuse_job(name, z3)])
        assert f"stage3_max_reuse_distance {dist}: the embedding/lm_head gather buffer" in out, out
        assert said[dist] in out, out
        same(d, f"r2_{tag}", name)
        evals = lambda x: [m["eval_loss"] for m in u.metrics(str(d / x)) if "eval_loss" in m]
        assert evals(name) == evals(f"r2_{tag}") and evals(name), (evals(name), evals(f"r2_{tag}"))


def test_stage3_matches_one_rank_with_accumulation(models):
    """Within the multi-rank tolerances of tests/dist/test_train_mpi.py close()."""
    d = models["tiny"]
    assert u.run("train", job(d, "one_acc4", 4, {"stage": 0})).returncode == 0
    run_ok(4, ["train", job(d, "s3_four", 1, {"stage": 3, "stage3_param_persistence_threshold": 0})])
    for s, r in zip(u.step_lines(str(d / "s3_four")), u.step_lines(str(d / "one_acc4"))):
        assert abs(s["loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (s, r)
        assert abs(s["grad_norm"] - r["grad_norm"]) <= 1e-5 * abs(r["grad_norm"]), (s, r)
    wa, wb = weights(str(d / "s3_four")), weights(str(d / "one_acc4"))
    dd = np.concatenate([np.abs(wa[k].astype(np.float64) - wb[k]).ravel() for k in sorted(wa)])
    assert dd.max() <= 0.02 * LR * STEPS and np.mean(dd > 1e-6) <= 1e-3, (dd.max(), np.mean(dd > 1e-6))


def resumable_job(d, name, prec, train_opts=None):
    """A global batch of 12 (micro-batch 2): the accumulation follows the rank count (1 rank: 6, 2: 3, 3: 2),
    so the same job runs at any of those world sizes on the same 12 examples a step."""
    ds = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    if prec:
        ds[prec] = {"enabled": True}
    opts = dict({"max_steps": STEPS}, **(train_opts or {}))
    return u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", T=16, train_opts=opts, ds=ds)


@pytest.mark.parametrize("prec", [None, "fp16"])
def test_stage3_resumes_bit_for_bit_and_at_another_rank_count(models, prec):
    d = models["tiny"]
    straight = f"z3_straight_{prec}"
    run_ok(2, ["train", resumable_job(d, straight, prec)])
    saved = f"z3_saved_{prec}"
    j = resumable_job(d, saved, prec, train_opts={"save_steps": 2})
    run_ok(2, ["train", j, "--set", "train.max_steps=2"])
    # the checkpoint holds each rank's part of the optimizer state and the fp32 master gathered into one file
    ck = d / saved / "checkpoint-2"
    assert {"optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"} <= set(os.listdir(ck))
    for n in (2, 3, 1):
        out = d / f"z3_resumed{n}_{prec}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(d / saved, out)
        args = ["train", j, "--set", f"output_dir={out.name}"]
        if n == 1:
            assert u.run(*args).returncode == 0
        else:
            run_ok(n, args)
        a, b = u.step_lines(str(d / straight)), u.step_lines(str(out))
        assert [m["step"] for m in b] == [1, 2, 3, 4]
        wa, wb = weights(str(d / straight)), weights(str(out))
        if n == 2:  # same rank count: bit for bit
            assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]
            for k in wa:
                assert np.array_equal(wa[k], wb[k]), k
        else:  # another order of the gradient sums: stage 2's tolerances (fp16: its sharded-master ones)
            for x, y in zip(a, b):
                assert abs(x["loss"] - y["loss"]) <= (1e-4 if prec else 1e-5) * abs(x["loss"]), (x, y)
            dd = np.concatenate([np.abs(wa[k].astype(np.float64) - wb[k]).ravel() for k in sorted(wa)
                                 if "k_proj.bias" not in k])
            assert dd.max() <= 0.02 * LR * STEPS, dd.max()


def test_stage3_final_is_a_whole_hf_folder_and_eval_runs_on_uneven_ranks(models):
    """final/ is gathered from the shards into one normal model.safetensors; an eval set whose batches do
    not divide over 3 ranks still runs (a rank with no batch left takes part in the gathers only)."""
    d = models["tiny"]
    u.write_tokens(str(d / "eval.jsonl"), 5, 16, 2)
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": z3}
    p = u.write_job(str(d / "ev.json"), "model", "ev", "train.jsonl", eval_="eval.jsonl", T=16,
                    train_opts={"max_steps": 2, "eval_steps": 1}, ds=ds)
    run_ok(3, ["train", p])
    fin = d / "ev" / "final"
    w = st.read(str(fin / "model.safetensors"))
    src = st.read(str(d / "model" / "model.safetensors"))
    assert set(w) == set(src) and all(w[k].shape == src[k].shape for k in w)
    assert (fin / "config.json").exists()


def test_stage3_refusals(models):
    d = models["tiny"]
    # (LoRA at stage 3 runs: tests/dist/test_zero3_lora_mpi.py)
    # an offload_param device other than cpu/none
    p = job(d, "badoff", 1, {"stage": 3, "offload_param": {"device": "nvme"}})
    r = u.run("train", p, check=False)
    assert r.returncode != 0 and "offload_param.device" in r.stderr, r.stderr


def test_stage3_notes(models):
    """What the stage-3 keys mean here is said: "auto" resolved from hidden_size as the HF Trainer fills it,
    a stage3_max_live_parameters below the two layers and the embedding the gathers hold, and the stage-3
    keys named as ignored at stage 2."""
    d = models["tiny"]
    z3 = {"stage": 3, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
          "stage3_max_live_parameters": 10}
    out = run_ok(2, ["train", job(d, "notes3", 1, z3, steps=1)])
    assert 'stage3_prefetch_bucket_size "auto" -> 3686' in out, out  # 0.9 x 64^2
    assert 'stage3_param_persistence_threshold "auto" -> 640' in out, out
    assert "stage3_max_live_parameters 10 is below" in out, out
    assert "stage3_max_reuse_distance 1e+09: the embedding/lm_head gather buffer" in out, out  # the default
    assert "stays gathered between its uses" in out, out
    out = run_ok(2, ["train", job(d, "notes2", 1, {"stage": 2, "stage3_max_live_parameters": 10}, steps=1)])
    assert "applies to ZeRO stage 3 only" in out, out


def test_stage3_example_config(models):
    """examples/ds-zero3-offload.json (the recipe at stage 3) runs as written on 4 ranks with its batch
    scaled down, and resolves its "auto" values from the model's hidden_size."""
    d = models["tiny"]
    root = os.path.join(HERE, "..", "..")
    ds = json.load(open(os.path.join(root, "examples", "ds-zero3-offload.json")))
    assert ds["zero_optimization"]["stage"] == 3
    ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = 8, 1, 2
    ds["scheduler"]["params"]["warmup_num_steps"] = 1
    (d / "ds3.json").write_text(json.dumps(ds))
    job = {"model": "model", "output_dir": "ex3", "deepspeed": "ds3.json",
           "data": {"train": "train.jsonl", "seq_len": 16, "packing": False, "shuffle": False},
           "train": {"max_steps": 2, "log_steps": 1, "seed": 1}}
    (d / "ex3.json").write_text(json.dumps(job))
    out = run_ok(4, ["train", str(d / "ex3.json")])
    assert "ZeRO stage 3" in out and 'reduce_bucket_size "auto" -> 4096' in out, out
    assert len(u.step_lines(str(d / "ex3"))) == 2
