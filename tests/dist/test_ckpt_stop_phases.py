"""A stop request at each phase of a sharded-master checkpoint write (issue 42
item 9), CI-sized: scripts/ckpt-stop-stress runs 2-rank ZeRO-2 fp16 offload
jobs under real mpirun with SIGTERM raised inside a rank at every phase of the
announce/serve gather protocol and the checkpoint's agreements (the fault
points of src/core/fault.h), on the writer and on the server rank, and a few
SIGTERMs from outside while a checkpoint is written. Every try must end in
exit 130 with whole checkpoints, no glibc or sanitizer report, and a resume
byte-identical to the uninterrupted run. The long run (500 tries, release and
ASan builds) is the same script: docs/robustness.md."""
import os
import subprocess
import sys

from test_train_mpi import pytestmark, u  # noqa: F401  (the mpirun / MPI-build skips)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "ckpt-stop-stress")


def stress(*args):
    p = subprocess.run([sys.executable, SCRIPT, "--qtune", u.QTUNE, "--seed", "7", *args], capture_output=True,
                       text=True, timeout=900)
    return p


def test_stop_at_every_phase_of_the_sharded_write():
    # 11 phases, each once, on the rank that passes it; the last try is resumed and compared
    p = stress("--mode", "phase", "--tries", "11", "--resume-every", "11", "--expect-stop")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "11 of 11 tries clean (11 stopped and saved" in p.stdout, p.stdout


def test_sigterm_from_outside_during_a_checkpoint():
    p = stress("--mode", "kill", "--tries", "3", "--resume-every", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 of 3 tries clean" in p.stdout, p.stdout
