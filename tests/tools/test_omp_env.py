"""qtune makes OpenMP's idle threads spin briefly, then sleep (libgomp spin count 3000) unless the
environment chooses: src/cli/main.c sets the variable and executes itself again before any work.
OMP_DISPLAY_ENV=verbose makes libgomp print the spin count it uses (the last print is the process
that runs the command)."""
import os
import subprocess

from conftest import QTUNE, qtune


def spin_count(extra):
    qtune("--version", check=0)  # fails with a clear message when QTUNE_BIN is not set
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra, OMP_DISPLAY_ENV="verbose")
    p = subprocess.run([QTUNE, "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "qtune" in p.stdout, p.stderr
    lines = [l for l in p.stderr.splitlines() if "GOMP_SPINCOUNT" in l]
    assert lines, f"libgomp printed no GOMP_SPINCOUNT line:\n{p.stderr}"
    return lines[-1].split("=")[1].strip().strip("'")


def test_default_is_a_short_spin():
    assert spin_count({}) == "3000"


def test_environment_wins():
    assert spin_count({"OMP_WAIT_POLICY": "active"}) not in ("0", "3000")
    assert spin_count({"OMP_WAIT_POLICY": "passive"}) == "0"
    assert spin_count({"GOMP_SPINCOUNT": "1000"}) == "1000"


def test_pinning_survives_the_re_exec():
    """With OMP_PROC_BIND set, libgomp pins the first process's thread to one place before main; the
    re-executed process must still see every place (before the fix it saw one CPU and ran all threads on
    it, half the speed at 2 threads). Also: a taskset restriction is kept, not widened."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        import pytest
        pytest.skip("needs 2 CPUs")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_PROC_BIND="close", OMP_PLACES="cores", OMP_DISPLAY_ENV="true")
    p = subprocess.run([QTUNE, "--version"], capture_output=True, text=True, env=env, timeout=60)
    places = [l.split("=")[1].strip().strip("'") for l in p.stderr.splitlines() if "OMP_PLACES" in l]
    assert len(places) == 2 and places[0] == places[1] and places[1].count("{") == len(cpus), p.stderr
    one = subprocess.run(["taskset", "-c", str(cpus[-1]), QTUNE, "--version"], capture_output=True, text=True,
                         env=env, timeout=60)
    places = [l.split("=")[1].strip().strip("'") for l in one.stderr.splitlines() if "OMP_PLACES" in l]
    assert places and places[-1] == "{%d}" % cpus[-1], one.stderr
