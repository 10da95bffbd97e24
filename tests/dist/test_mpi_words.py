"""Issue 41 item 4, the words of an MPI job, under real mpirun:
- a warning is said once, by rank 0, not once per rank;
- Ctrl-C on mpirun says at once that mpirun will not wait for the checkpoint
  and to stop with `qtune stop OUTPUT_DIR`;
- `qtune stop` ends the job with status 130, and rank 0 says before mpirun's
  own "exited with non-zero status" banner that nothing failed (the banner
  cannot be silenced while the ranks exit 130, which tells a script or a
  scheduler that the job stopped rather than finished: docs/robustness.md)."""
import os
import signal
import subprocess
import time

from test_train_mpi import mpirun, mpirun_popen, u  # noqa: F401
from test_train_mpi import pytestmark  # noqa: F401  (the mpirun / MPI-build skips)


def job(d, name, **kw):
    if not os.path.exists(d / "model"):
        u.init_model(str(d / "model"), preset="tiny", seed=3)
        u.write_tokens(str(d / "train.jsonl"), 64, 16, 1)
    return u.write_job(str(d / f"{name}.json"), "model", name, "train.jsonl", T=16, **kw)


def wait_steps(out, n, p, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and p.poll() is None:
        try:
            if len(u.step_lines(out)) >= n:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return False


def test_warnings_once_not_once_per_rank(tmp_path):
    j = job(tmp_path, "warn_once", lora={"r": 4, "lora_aplha": 8},
            ds={"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "auto"}},
            train_opts={"max_steps": 1})
    rc, log = mpirun(3, ["train", j])
    assert rc == 0, log
    assert log.count("unknown key 'lora.lora_aplha'") == 1, log
    assert log.count('fp16.enabled "auto" -> false: this run trains in fp32') == 1, log


def test_ctrl_c_on_mpirun_says_it_will_not_wait(tmp_path):
    j = job(tmp_path, "ctrl_c", ds={"train_micro_batch_size_per_gpu": 1}, train_opts={"max_steps": 100000})
    out = str(tmp_path / "ctrl_c")
    p = mpirun_popen(2, ["train", j])
    try:
        assert wait_steps(out, 2, p), "the job did not start"
        p.send_signal(signal.SIGINT)
        log, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "mpirun will not wait for it" in log, log
    assert f"run `qtune stop {out}` instead" in log, log


def test_qtune_stop_says_the_banner_is_no_failure(tmp_path):
    j = job(tmp_path, "stopped", ds={"train_micro_batch_size_per_gpu": 1}, train_opts={"max_steps": 100000})
    out = str(tmp_path / "stopped")
    p = mpirun_popen(2, ["train", j])
    try:
        assert wait_steps(out, 2, p), "the job did not start"
        s = subprocess.run([u.QTUNE, "stop", out], capture_output=True, text=True, env=u.env(), timeout=60)
        assert s.returncode == 0, s.stderr
        log, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, log
    assert log.count("every rank exits with status 130 (stopped, resumable)") == 1, log
    assert "nothing failed" in log, log
