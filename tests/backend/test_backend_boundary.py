"""The backend boundary (issue 18, docs/architecture.md): outside src/backend/
no file includes a backend's own header (backend/<name>/...) or the
implementers' header with the table (backend/backend_impl.h; the interface is
backend/backend.h's qt_be_* calls), and scripts/count-host-touches finds no host touch of
tensor memory in src/{model,optim,dist,train}. Both checks are also run on a
planted offender, so they are seen to fail."""
import os
import re
import subprocess
import sys

SRC = os.environ.get("QTUNE_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INCLUDE = re.compile(r'^\s*#\s*include\s+"(backend/(?:[a-z0-9_]+/[^"]+|backend_impl\.h))"', re.M)
# A device transport may include its backend's function table and nothing else of it (scripts/count-host-touches
# says why): the HCCL transport, the Ascend backend's collective half.
DEVICE_TRANSPORT_INCLUDES = {os.path.join("src", "dist", "transport_hccl.c"): {"backend/ascend/ascend_internal.h"}}


def offenders(root):
    """FILE:LINE: header for every backend-header include outside src/backend/."""
    bad = []
    src = os.path.join(root, "src")
    for d, _, files in os.walk(src):
        rel = os.path.relpath(d, src)
        if rel == "backend" or rel.startswith("backend" + os.sep):
            continue
        for f in files:
            if not f.endswith((".c", ".h")):
                continue
            text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
            for m in INCLUDE.finditer(text):
                if m.group(1) in DEVICE_TRANSPORT_INCLUDES.get(os.path.join("src", rel, f), set()):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                bad.append("%s:%d: %s" % (os.path.join("src", rel, f), line, m.group(1)))
    return bad


def count(root):
    p = subprocess.run([sys.executable, os.path.join(SRC, "scripts", "count-host-touches"), "--list", root],
                       capture_output=True, text=True, check=True)
    total = int(re.search(r"outside src/backend/: (\d+)", p.stdout).group(1))
    return total, p.stdout


def test_no_backend_header_outside_src_backend():
    assert offenders(SRC) == []


def test_no_host_touch_counted():
    total, listing = count(SRC)
    assert total == 0, listing


def test_checks_catch_a_planted_offender(tmp_path):
    d = tmp_path / "src" / "model"
    d.mkdir(parents=True)
    (d / "bad.c").write_text('#include "backend/cpu/ops.h"\n'
                             '#include "backend/backend_impl.h"\n'
                             'void f(float *grads, size_t n) {\n'
                             '    memset(grads, 0, n * sizeof(float));\n'
                             '    for (size_t i = 0; i < n; i++) grads[i] *= 2.0f;\n'
                             '    op_acc(grads, grads, n);\n'
                             '}\n')
    assert offenders(str(tmp_path)) == ["src/model/bad.c:1: backend/cpu/ops.h", "src/model/bad.c:2: backend/backend_impl.h"]
    total, listing = count(str(tmp_path))
    assert total == 4, listing
    for kind in ("include", "mem", "element", "op-call"):
        assert ": %s: " % kind in listing
