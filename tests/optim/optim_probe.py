"""Finds and runs the optim_probe helper (tests/unit/optim/optim_probe.c)."""
import os
import subprocess


def probe_path():
    build = os.environ.get("QTUNE_BUILD_DIR")
    assert build, "QTUNE_BUILD_DIR is not set: run these tests through ctest, or set it to the build folder"
    path = os.path.join(build, "tests", "unit", "optim", "optim_probe")
    assert os.path.exists(path), f"{path} is missing: build the optim_probe target first"
    return path


def run(args, stdin=""):
    out = subprocess.run([probe_path()] + [str(a) for a in args], input=stdin, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"optim_probe {args} failed ({out.returncode}): {out.stderr}"
    return out.stdout
