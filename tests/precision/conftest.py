"""Helpers for the mixed-precision tests: the reference driver's model and
batch makers (tests/ref/conftest.py, loaded under another name) and the
training helpers (tests/train/trainutil.py)."""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(SRC, "build-prec"))
os.environ.setdefault("QTUNE_BUILD_DIR", BUILD)
os.environ.setdefault("QTUNE_BIN", os.path.join(BUILD, "src", "cli", "qtune"))
sys.path.insert(0, os.path.join(SRC, "tests", "ref"))
sys.path.insert(0, os.path.join(SRC, "tests", "train"))

_spec = importlib.util.spec_from_file_location("ref_helpers", os.path.join(SRC, "tests", "ref", "conftest.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

import trainutil  # noqa: E402


def driver(tmp, model_dir, batch, *opts, tag="out", env=None):
    """Runs qtune_ref_driver (tests/ref) and returns its dump."""
    import json
    import subprocess
    bp = os.path.join(tmp, tag + "-batch.json")
    with open(bp, "w") as f:
        json.dump(batch, f)
    out = os.path.join(tmp, tag + ".safetensors")
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    r = subprocess.run([ref.DRIVER, model_dir, bp, out, *opts], capture_output=True, text=True, env=e)
    assert r.returncode == 0, r.stderr
    return ref.st.read(out)


@pytest.fixture(scope="session", autouse=True)
def _need_binaries():
    for p in (ref.DRIVER, trainutil.QTUNE):
        if not os.path.exists(p):
            pytest.fail("%s is not built; build the project (cmake --build) first" % p)


EMULATE = {"QTUNE_BF16_EMULATE": "1"}
