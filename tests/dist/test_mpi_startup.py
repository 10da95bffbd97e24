"""MPI start-up has a deadline (issue 42 item 5; src/dist/startup.c), under
real mpirun. MPI_Init and the communicator copies after it wait for every
rank and had no deadline: a rank stopped before or during them hung the whole
job forever, with no message. Now every waiting rank gives up after
QTUNE_DIST_TIMEOUT and names the rank that never arrived, and mpirun ends the
job."""
import glob
import os
import signal
import subprocess
import time

from test_train_mpi import MPIRUN, MPI_ARGS, rank_pids, u  # noqa: F401
from test_train_mpi import pytestmark  # noqa: F401  (the mpirun / MPI-build skips)


def job(tmp_path):
    u.init_model(str(tmp_path / "model"), preset="tiny", seed=3)
    u.write_tokens(str(tmp_path / "train.jsonl"), 16, 16, 1)
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    return u.write_job(str(tmp_path / "job.json"), "model", "out", "train.jsonl", T=16, ds=ds,
                       train_opts={"max_steps": 2})


def start(n, script, job_path):
    """mpirun -np n sh -c SCRIPT, where SCRIPT ends in exec qtune train JOB"""
    e = u.env()
    e["QTUNE_DIST_TIMEOUT"] = "3"
    cmd = script + '; exec "$0" train "$1"'
    return subprocess.Popen([MPIRUN, *MPI_ARGS, "-np", str(n), "sh", "-c", cmd, u.QTUNE, job_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                            start_new_session=True)


def finish(p, stopped, timeout=60):
    """mpirun's output and how long it took; a job still there is killed (and fails the test)"""
    t0 = time.monotonic()
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out += "\n(the job still hung after %d s)" % timeout
    finally:
        for pid in stopped:  # mpirun kills them; make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return out, time.monotonic() - t0


def test_rank_that_never_starts_is_named(tmp_path):
    j = job(tmp_path)
    # rank 1 stops itself before it becomes qtune: it never reaches MPI_Init
    p = start(2, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then kill -STOP $$; fi', j)
    pids = rank_pids(p.pid, 2)
    out, took = finish(p, [pids[1]])
    assert p.returncode != 0 and took < 50, out
    assert ("qtune: error: rank 0: MPI start-up did not finish within 3 s (QTUNE_DIST_TIMEOUT); rank(s) 1 never "
            "reached MPI start-up" in out), out
    assert not os.path.exists(tmp_path / "out" / "final"), out


def test_rank_stopped_inside_start_up_is_named(tmp_path):
    j = job(tmp_path)
    # rank 2 comes late, so ranks 0 and 1 wait in MPI start-up; rank 1 is stopped there
    p = start(3, 'if [ "$OMPI_COMM_WORLD_RANK" = 2 ]; then sleep 2; fi', j)
    pids = rank_pids(p.pid, 3)
    marker = None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and not marker:  # rank 1 has reached start-up
        found = glob.glob("/dev/shm/qtune-start-%d-%d-*/1" % (os.getuid(), p.pid))
        marker = found[0] if found else None
        time.sleep(0.01)
    os.kill(pids[1], signal.SIGSTOP)
    out, took = finish(p, [pids[1]])
    assert marker, "rank 1 left no start-up marker:\n" + out
    assert p.returncode != 0 and took < 50, out
    # rank 0 gives up first (rank 2 started 2 s later), and mpirun ends the job
    assert ("qtune: error: rank 0: MPI start-up did not finish within 3 s (QTUNE_DIST_TIMEOUT); rank(s) 1 are "
            "stopped (SIGSTOP") in out, out
    assert not os.path.exists(tmp_path / "out" / "final"), out


def test_start_up_leaves_no_markers(tmp_path):
    j = job(tmp_path)
    p = start(2, "true", j)
    out, _ = finish(p, [])
    assert p.returncode == 0, out
    assert os.path.exists(tmp_path / "out" / "final"), out
    assert not glob.glob("/dev/shm/qtune-start-%d-%d-*" % (os.getuid(), p.pid)), out
