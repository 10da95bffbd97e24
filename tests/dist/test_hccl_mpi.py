"""The HCCL transport (src/dist/transport_hccl.c) under real mpirun, on the CPU stand-in of CANN
(tests/unit/backend_parity/acl_standin.c + hccl_standin.c, HCCL's collectives over MPI) through
QTUNE_ASCEND_LIB: ranks on the Ascend backend ("npu") start HCCL (the root info broadcast over MPI), and every
device collective of dist/transport.h gives MPI's results exactly at 2 and 3 ranks (tests/dist/hccl_check.c);
ZeRO stage 2 on the NPU's memory (zero.c's bucketed reductions to the owners, the norm, the parameter
all-gather) gives the same; a stalled rank ends the job at the collective deadline with its name, as under MPI.
Training across npu ranks against 1 rank and against the cpu backend is tests/dist/test_npu_zero_mpi.py."""
import os
import shutil
import subprocess
import time

import pytest

BUILD = os.environ.get("QTUNE_BUILD_DIR", "")
EXE = os.path.join(BUILD, "tests", "dist", "hccl_check")
STANDIN = os.path.join(BUILD, "tests", "acl_standin", "libqtune_acl_standin.so")
MPIRUN = shutil.which("mpirun")


def built_with_mpi():
    try:
        with open(os.path.join(BUILD, "generated", "qtune_config.h")) as f:
            return "#define QTUNE_HAVE_MPI 1" in f.read()
    except OSError:
        return True


pytestmark = [
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (apt-get install openmpi-bin)"),
    pytest.mark.skipif(not built_with_mpi(), reason="this build has no MPI (QTUNE_HAVE_MPI 0)"),
    pytest.mark.skipif(not os.path.exists(EXE), reason=f"{EXE} not built (target hccl_check)"),
]

MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]


def run(n, *args, env=None, timeout=120):
    e = dict(os.environ, OMP_NUM_THREADS="1", QTUNE_ASCEND_LIB=STANDIN, QTUNE_ACL_STANDIN_DEVICES="4")
    e.pop("QTUNE_BACKEND", None)
    e.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run([MPIRUN, *MPI_ARGS, "-np", str(n), EXE, *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=timeout)
    p.elapsed = time.monotonic() - t0
    return p


def checksum(p):
    return [l for l in p.stdout.splitlines() if l.startswith("checksum ")]


@pytest.mark.parametrize("n", [2, 3])
def test_hccl_collectives_equal_mpi(n):
    hccl = run(n)
    assert hccl.returncode == 0 and "hccl ok" in hccl.stdout, hccl.stdout + hccl.stderr
    assert "transport HCCL" in hccl.stdout
    mpi = run(n, env={"QTUNE_DIST_TRANSPORT": "mpi"})  # the same program through MPI's staged host copies
    assert mpi.returncode == 0 and "hccl ok" in mpi.stdout, mpi.stdout + mpi.stderr
    assert "transport MPI" in mpi.stdout
    assert checksum(hccl) == checksum(mpi) and checksum(hccl)


def test_hccl_stalled_rank_named_at_deadline():
    p = run(3, "--hang-rank", 1, env={"QTUNE_DIST_TIMEOUT": "3"})
    text = p.stdout + p.stderr
    assert p.returncode != 0
    assert p.elapsed < 60
    assert "transport HCCL" in text, text
    assert "did not complete within 3 s" in text, text
    assert "rank(s) 1 stopped responding" in text, text


def test_train_on_npu_ranks_starts_hccl(tmp_path):
    """qtune train at 2 ranks on "npu" (the stand-in): the trainer hands the backend to dist, HCCL starts, the
    run line says so, and the job completes (its numbers: test_npu_zero_mpi.py)."""
    qtune = os.environ.get("QTUNE_BIN", "")
    if not os.path.exists(qtune):
        pytest.skip("QTUNE_BIN is not set")
    subprocess.run([qtune, "init", "--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"], check=True,
                   capture_output=True)
    (tmp_path / "t.jsonl").write_text("".join('{"input_ids": [%s]}\n' % ",".join(map(str, range(i, i + 30)))
                                              for i in range(1, 17)))
    (tmp_path / "j.json").write_text(
        '{"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "seq_len": 32, "packing": true}, '
        '"train": {"max_steps": 2, "save_steps": 0}, "deepspeed": {"train_micro_batch_size_per_gpu": 2, '
        '"gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}}\n')
    e = dict(os.environ, OMP_NUM_THREADS="1", QTUNE_ASCEND_LIB=STANDIN, QTUNE_ACL_STANDIN_DEVICES="4",
             QTUNE_BACKEND="npu")
    p = subprocess.run([MPIRUN, *MPI_ARGS, "-np", "2", qtune, "train", str(tmp_path / "j.json")], capture_output=True,
                       text=True, env=e, timeout=120)
    text = p.stdout + p.stderr
    assert "2 rank(s) rows of 32 tokens, collectives over HCCL" in text, text
    assert p.returncode == 0, text
