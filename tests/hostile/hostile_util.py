"""Helpers for the hostile-input battery: run the qtune CLI on a bad input and
check the contract for errors (docs/robustness.md): a non-zero exit of 1 or 2
(never a signal), one clear sentence on stderr naming what is wrong, no
sanitizer report, and bounded memory (peak RSS measured with wait4)."""
import json
import os
import re
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QTUNE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
QTUNE = os.environ.get("QTUNE_BIN") or os.path.join(SRC, "build-harden", "src", "cli", "qtune")
# QTUNE_ASAN_BIN: an AddressSanitizer/UBSan build of qtune to run the battery against instead
if os.environ.get("QTUNE_ASAN_BIN"):
    QTUNE = os.environ["QTUNE_ASAN_BIN"]
sys.path.insert(0, os.path.join(SRC, "tests", "ref"))

# no bad input may make qtune's peak memory grow past this (the tiny test
# model needs well under 100 MB; the limit catches a length field sizing an
# allocation)
MAX_RSS_BYTES = 768 << 20


def env(**extra):
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    e.pop("QTUNE_LOG", None)
    e.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0")
    e.update({k: str(v) for k, v in extra.items()})
    return e


class Result:
    def __init__(self, rc, out, err, maxrss):
        self.returncode, self.stdout, self.stderr, self.maxrss = rc, out, err, maxrss

    def __repr__(self):
        return "rc=%d maxrss=%.1f MB\nstdout: %s\nstderr: %s" % (self.returncode, self.maxrss / 2**20,
                                                                self.stdout[-2000:], self.stderr[-4000:])


def run(args, cwd=None, stdin=None, timeout=120, **extra_env):
    """Runs qtune ARGS; returns Result with the child's own peak RSS."""
    import tempfile
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        p = subprocess.Popen([QTUNE] + [str(a) for a in args], cwd=cwd, env=env(**extra_env), stdout=fo, stderr=fe,
                             stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        if stdin is not None:
            try:
                p.stdin.write(stdin if isinstance(stdin, bytes) else stdin.encode())
            except BrokenPipeError:
                pass
            p.stdin.close()
        import signal
        import threading
        timer = threading.Timer(timeout, lambda: p.send_signal(signal.SIGKILL))
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        return Result(p.returncode, fo.read().decode("utf-8", "replace"), fe.read().decode("utf-8", "replace"),
                      ru.ru_maxrss * 1024)


def ok(args, **kw):
    r = run(args, **kw)
    assert r.returncode == 0, r
    return r


def expect_error(args, *must, code=(1, 2), max_rss=MAX_RSS_BYTES, **kw):
    """The contract for a bad input. `must`: substrings (case-insensitive) or
    compiled regexes the error must contain, e.g. the file or field name."""
    r = run(args, **kw)
    assert r.returncode >= 0, "killed by signal %d: %r" % (-r.returncode, r)
    assert r.returncode in code, r
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r
    err_lines = [l for l in r.stderr.splitlines() if l.startswith("qtune") and ("error" in l or ": " in l)]
    assert err_lines, r
    msg = err_lines[-1]
    # one sentence on one line, not a dump
    assert 20 <= len(msg) <= 1200, r
    for m in must:
        if isinstance(m, re.Pattern):
            assert m.search(msg), "%r not in %r" % (m.pattern, msg)
        else:
            assert m.lower() in msg.lower(), "%r not in %r" % (m, msg)
    assert r.maxrss < max_rss, "peak RSS %.0f MB on a bad input: %r" % (r.maxrss / 2**20, r)
    return r


# ---------------------------------------------------------------------------
# building blocks

def st_bytes(header, data=b"", header_len=None):
    """A safetensors file from a header dict (written as is) and raw data."""
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + data


def write(path, data):
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode) as f:
        f.write(data)
    return path


def write_job(path, model, out, train, T=8, lora=None, train_opts=None, ds=None, data_opts=None, extra=None):
    job = {"model": model, "output_dir": out,
           "data": dict({"train": train, "seq_len": T, "packing": False, "shuffle": False}, **(data_opts or {})),
           "train": dict({"max_steps": 2, "log_steps": 1, "seed": 7}, **(train_opts or {}))}
    if lora:
        job["lora"] = lora
    job["deepspeed"] = ds if ds is not None else {"train_micro_batch_size_per_gpu": 1,
                                                  "gradient_accumulation_steps": 1}
    job.update(extra or {})
    with open(path, "w") as f:
        json.dump(job, f, indent=1)
    return path


def write_tokens(path, n=8, T=8, vocab=512, seed=0):
    import random
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            L = rng.randint(T // 2, T)
            a = rng.randint(1, vocab - 1)
            f.write(json.dumps({"input_ids": [(a + k) % (vocab - 1) + 1 for k in range(L)]}) + "\n")
    return path
