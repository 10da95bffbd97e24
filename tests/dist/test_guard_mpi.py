"""Several ranks on the guard backend (device memory the host cannot touch) under real mpirun. The transport
stages every collective through host copies when the backend's device memory is not host-readable
(dist_set_backend; CUDA under an MPI that is not CUDA-aware is the other such case), so ZeRO's and the
trainer's distributed paths run there: the all-reduce (stage 0), partitioned gradients (stage 2, with and
without offload), the sharded fp16 master with its all-gathers and the gathered checkpoint writes, resume, and ZeRO-3's
per-layer parameter gathers (broadcasts into device buffers).
Each gives the cpu backend's results bit for bit; a host touch of device memory would crash the guard run at
its line (SIGSEGV), and a staging copy in the wrong place would change the numbers."""
import os

import numpy as np
import pytest

from test_train_mpi import job, mpirun, setup, u, weights  # noqa: F401  (setup: the tiny model and data)
from test_train_mpi import pytestmark  # noqa: F401  (the mpirun / MPI-build skips)

TIMING = {"tokens_per_s", "elapsed_s", "mem_peak_bytes", "mem_peak_bytes_ranks", "comm_s", "comm_busy_s",
          "comm_wait_s", "device_peak_bytes", "device_peak_bytes_ranks"}


def steps(out):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in u.step_lines(out)]


def run(d, name, n, backend, *extra, **kw):
    rc, out = mpirun(n, ["train", job(d, name, 1, kw["stage"], kw["offload"], prec=kw.get("prec"),
                                      train_opts={"save_steps": 2}), *extra], env={"QTUNE_BACKEND": backend})
    assert rc == 0, f"{backend}: {out[-3000:]}"
    return str(d / name)


def same_bytes(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


@pytest.mark.parametrize("n,stage,offload,prec", [(2, 0, 0, None), (2, 2, 0, None), (2, 2, 1, "fp16"),
                                                   (3, 1, 1, "fp16"), (2, 3, 0, None), (3, 3, 1, "fp16")])
def test_guard_ranks_equal_cpu_ranks(setup, n, stage, offload, prec):
    kw = {"stage": stage, "offload": offload, "prec": prec}
    tag = f"n{n}_s{stage}_o{offload}_{prec or 'fp32'}"
    cpu = run(setup, f"cpu_{tag}", n, "cpu", **kw)
    grd = run(setup, f"guard_{tag}", n, "guard", **kw)
    assert steps(grd) == steps(cpu)
    for rel in ["final/model.safetensors", "checkpoint-4/model.safetensors", "checkpoint-2/model.safetensors"] + [
            f"checkpoint-2/{f}" for f in os.listdir(os.path.join(cpu, "checkpoint-2")) if f.startswith("optimizer-")]:
        assert same_bytes(os.path.join(grd, rel), os.path.join(cpu, rel)), rel


def test_guard_sharded_master_resumes_bit_for_bit(setup):
    kw = {"stage": 2, "offload": 1, "prec": "fp16"}
    straight = run(setup, "g_straight", 2, "guard", **kw)
    run(setup, "g_resumed", 2, "guard", "--set", "train.max_steps=2", **kw)
    resumed = run(setup, "g_resumed", 2, "guard", **kw)
    assert [s["loss"] for s in steps(resumed)] == [s["loss"] for s in steps(straight)]
    wa, wb = weights(straight), weights(resumed)
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("reuse", [0, 1000])
def test_guard_stage3_freed_vocabulary_buffer_equals_cpu(setup, reuse):
    """stage3_max_reuse_distance below the layers: the V x C buffer is freed after its reads and allocated
    again at the next (at 0 the lm_head's backward reads slices of it from a slice buffer); the guard's freed
    blocks fault when touched, so a read of a stale pointer would crash here; the results are the cpu's."""
    kw = {"stage": 3, "offload": 0, "prec": "fp16"}
    key = ["--set", f"deepspeed.zero_optimization.stage3_max_reuse_distance={reuse}"]
    cpu = run(setup, f"cpu_rd{reuse}", 2, "cpu", *key, **kw)
    grd = run(setup, f"guard_rd{reuse}", 2, "guard", *key, **kw)
    assert steps(grd) == steps(cpu) and steps(cpu)
    assert same_bytes(os.path.join(grd, "final/model.safetensors"), os.path.join(cpu, "final/model.safetensors"))
