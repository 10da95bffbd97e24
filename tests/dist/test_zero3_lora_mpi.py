"""LoRA at ZeRO-3 under real mpirun: the frozen base's matrices are partitioned over the ranks and gathered
layer by layer as full fine-tuning's weights are; the norm weights and biases and the adapter stay whole on
every rank, and the adapter takes stage 2's path (gradients reduce-scattered, optimizer state sharded, the
update all-gathered).

The gathers move bits (each owner broadcasts its part, in the dtype stage 2 reads the base in), so N ranks at
stage 3 equal N ranks at stage 2 bit for bit (losses, grad norms, the adapter), in fp32, fp16 and bf16, with and
without gradient checkpointing and prefetch, for Qwen2, Qwen3 and the original Qwen (a fused c_attn, an
untied lm_head); against 1 rank with N-fold accumulation within stage 2's multi-rank tolerances; checkpoints
resume bit for bit at the same rank count and within those tolerances at another; the guard backend equals
the cpu one."""
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_train_mpi import (LR, STEPS, built_with_mpi, close, mpirun, MPIRUN)  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import trainutil as u  # noqa: E402
import st  # noqa: E402

pytestmark = [
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (apt-get install openmpi-bin)"),
    pytest.mark.skipif(not built_with_mpi(), reason="this build has no MPI (QTUNE_HAVE_MPI 0)"),
    pytest.mark.skipif(not os.path.exists(u.QTUNE), reason=f"{u.QTUNE} not built"),
]

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for preset in ("tiny", "tiny-qwen3", "tiny-qwen"):
        d = tmp_path_factory.mktemp("z3l_" + preset.replace("-", "_"))
        u.init_model(str(d / "model"), preset=preset, seed=5)
        u.write_tokens(str(d / "train.jsonl"), 64, 16, 1)
        out[preset] = d
    return out


def job(d, name, accum, zero, prec=None, train_opts=None, lora=None, ds_extra=None):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}
    ds.update(ds_extra or {})
    if prec:
        ds[prec] = {"enabled": True}
    opts = dict({"max_steps": STEPS}, **(train_opts or {}))
    return u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", T=16, train_opts=opts, ds=ds,
                       lora=lora or LORA)


def run_ok(n, args, env=None):
    rc, out = mpirun(n, args, env=env)
    assert rc == 0, out
    return out


def adapter(out):
    return st.read(os.path.join(out, "final", "adapter_model.safetensors"))


def steps_of(out):
    return [(s["loss"], s["grad_norm"]) for s in u.step_lines(str(out))]


def same(d, a, b):
    assert steps_of(d / a) == steps_of(d / b)
    wa, wb = adapter(str(d / a)), adapter(str(d / b))
    assert set(wa) == set(wb)
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), k


Z2 = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 3000}


# tiny: tied embedding (the V x C buffer is gathered once and read by both); with modules_to_save lm_head the
# trained copy is whole in the master and only the embedding's role gathers the base; tiny-qwen: an untied
# lm_head (the V x C buffer alternates) and the fused c_attn (one gathered matrix, q, k and v its row slices)
@pytest.mark.parametrize("preset,n,prec,ckpt,save,pf", [
    ("tiny", 2, None, False, None, 5e7), ("tiny", 3, "fp16", True, None, 0), ("tiny", 4, "bf16", False, None, 5e7),
    ("tiny", 2, None, True, ["lm_head"], 5e7), ("tiny-qwen3", 2, "fp16", False, None, 5e7),
    ("tiny-qwen", 3, None, True, None, 5e7), ("tiny-qwen", 2, "bf16", False, ["wte"], 0)])
def test_lora_stage3_equals_stage2_bit_for_bit(models, preset, n, prec, ckpt, save, pf):
    d = models[preset]
    tag = f"{n}_{prec}_{int(ckpt)}_{int(bool(save))}"
    topts = {"gradient_checkpointing": ckpt}
    lora = dict(LORA, modules_to_save=save) if save else LORA
    run_ok(n, ["train", job(d, f"l2_{tag}", 1, Z2, prec, topts, lora)])
    z3 = dict(Z2, stage=3, stage3_prefetch_bucket_size=pf, stage3_param_persistence_threshold=0)
    out = run_ok(n, ["train", job(d, f"l3_{tag}", 1, z3, prec, topts, lora)])
    assert "ZeRO stage 3" in out, out
    same(d, f"l2_{tag}", f"l3_{tag}")


@pytest.mark.parametrize("preset,n,prec,save,reuse", [("tiny", 2, "fp16", None, 1000), ("tiny", 3, None, None, 0),
                                                      ("tiny", 2, None, ["lm_head"], 0),
                                                      ("tiny-qwen", 3, "bf16", None, 0)])
def test_lora_stage3_reuse_distance_bit_for_bit(models, preset, n, prec, save, reuse):
    """stage3_max_reuse_distance below the layers: the base's V x C buffer is freed after the lookup and after the
    lm_head's fused forward (a frozen lm_head has no backward read) and gathered again; with modules_to_save
    lm_head only the lookup reads it; tiny-qwen's untied lm_head is the second table. Stage 2's bits."""
    d = models[preset]
    tag = f"rd_{n}_{prec}_{int(bool(save))}_{reuse}"
    lora = dict(LORA, modules_to_save=save) if save else LORA
    run_ok(n, ["train", job(d, f"l2_{tag}", 2, Z2, prec, None, lora)])
    z3 = dict(Z2, stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=reuse)
    out = run_ok(n, ["train", job(d, f"l3_{tag}", 2, z3, prec, None, lora)])
    assert f"stage3_max_reuse_distance {reuse}: the embedding/lm_head gather buffer" in out, out
    same(d, f"l2_{tag}", f"l3_{tag}")


@pytest.mark.parametrize("n,prec", [(4, None), (3, "bf16")])
def test_lora_stage3_matches_one_rank_with_accumulation(models, n, prec):
    """Within the multi-rank tolerances of tests/dist/test_train_mpi.py close(); bf16 within the stage-2
    16-bit ones (2e-4 of the loss; the adapter's movement as in fp32: the adapter is trained in fp32)."""
    d = models["tiny"]
    lora = dict(LORA, lora_dropout=0.0)  # dropout masks follow the rank: 1 rank draws other ones
    one, many = f"lone_acc{n}_{prec}", f"l3_many{n}_{prec}"
    assert u.run("train", job(d, one, n, {"stage": 0}, prec, lora=lora)).returncode == 0
    run_ok(n, ["train", job(d, many, 1, {"stage": 3, "stage3_param_persistence_threshold": 0}, prec, lora=lora)])
    tol = 2e-4 if prec else 1e-5
    for s, r in zip(u.step_lines(str(d / many)), u.step_lines(str(d / one))):
        assert abs(s["loss"] - r["loss"]) <= tol * abs(r["loss"]), (s, r)
        assert abs(s["grad_norm"] - r["grad_norm"]) <= 10 * tol * abs(r["grad_norm"]), (s, r)
    ok, why = close(adapter(str(d / many)), adapter(str(d / one)))
    assert ok, why


def resumable_job(d, name, prec, train_opts=None):
    """A global batch of 12 (micro-batch 2): the accumulation follows the rank count (1 rank: 6, 2: 3, 3: 2)."""
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
         "offload_param": {"device": "cpu"}}
    ds = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": z}
    if prec:
        ds[prec] = {"enabled": True}
    opts = dict({"max_steps": STEPS}, **(train_opts or {}))
    return u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", T=16, train_opts=opts, ds=ds,
                       lora=dict(LORA, lora_dropout=0.0))


@pytest.mark.parametrize("preset,prec", [("tiny", None), ("tiny-qwen", "fp16")])
def test_lora_stage3_resumes_bit_for_bit_and_at_another_rank_count(models, preset, prec):
    d = models[preset]
    straight = f"l3_straight_{prec}"
    run_ok(2, ["train", resumable_job(d, straight, prec)])
    saved = f"l3_saved_{prec}"
    j = resumable_job(d, saved, prec, train_opts={"save_steps": 2})
    run_ok(2, ["train", j, "--set", "train.max_steps=2"])
    ck = d / saved / "checkpoint-2"
    assert {"optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"} <= set(os.listdir(ck))
    for n in (2, 3, 1):
        out = d / f"l3_resumed{n}_{prec}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(d / saved, out)
        args = ["train", j, "--set", f"output_dir={out.name}"]
        if n == 1:
            assert u.run(*args).returncode == 0
        else:
            run_ok(n, args)
        a, b = u.step_lines(str(d / straight)), u.step_lines(str(out))
        assert [m["step"] for m in b] == [1, 2, 3, 4]
        wa, wb = adapter(str(d / straight)), adapter(str(out))
        if n == 2:
            assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]
            for k in wa:
                assert np.array_equal(wa[k], wb[k]), k
        else:
            for x, y in zip(a, b):
                assert abs(x["loss"] - y["loss"]) <= (1e-4 if prec else 1e-5) * abs(x["loss"]), (x, y)
            ok, why = close(wa, wb)
            assert ok, why
    # final/ is a normal PEFT adapter: its config and the adapter's tensors only, no base weights
    fin = d / straight / "final"
    assert (fin / "adapter_config.json").exists() and not (fin / "model.safetensors").exists()
    assert all("lora_" in k for k in adapter(str(d / straight)))


def test_lora_stage3_guard_equals_cpu_and_eval_on_uneven_ranks(models):
    """The guard backend (device memory the host cannot touch) gives the cpu backend's bits; an eval set
    whose batches do not divide over 3 ranks still runs (a rank with no batch left takes part in the
    gathers only)."""
    d = models["tiny"]
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"}}
    for be in ("cpu", "guard"):
        run_ok(2, ["train", job(d, f"l3_be_{be}", 1, z3, "bf16", {"gradient_checkpointing": True})],
               env={"QTUNE_BACKEND": be})
    same(d, "l3_be_cpu", "l3_be_guard")
    u.write_tokens(str(d / "eval.jsonl"), 5, 16, 2)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": z3}
    p = u.write_job(str(d / "lev.json"), "model", "lev", "train.jsonl", eval_="eval.jsonl", T=16,
                    train_opts={"max_steps": 2, "eval_steps": 1}, ds=ds, lora=LORA)
    run_ok(3, ["train", p])
    assert any("eval_loss" in m for m in u.metrics(str(d / "lev")))


def test_qlora_stage3_is_refused(models):
    d = models["tiny"]
    p = job(d, "q3", 1, {"stage": 3}, "bf16")
    import json
    j = json.load(open(p))
    j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    json.dump(j, open(p, "w"))
    rc, out = mpirun(2, ["train", p])
    assert rc != 0 and "ZeRO stage 3 does not partition a 4-bit (QLoRA) base" in out, out
    assert "stage 2" in out
