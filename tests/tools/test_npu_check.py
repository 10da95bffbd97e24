"""scripts/npu-check rehearsed on the CPU stand-in of CANN (NPU_CHECK_STANDIN=1, this build): every step runs
and lands in REPORT.md: the doctor's Ascend rows, op parity on the ops CTest runs, HCCL at 2 ranks (which passes
on the stand-in), and the 20-step runs against the CPU, where the NPU run stops at the first op the backend has
not written yet, as the report then says. The timed case is left out (NPU_CHECK_SKIP=timed): minutes here."""
import os
import shutil
import subprocess

import pytest

from conftest import SRC

BUILD = os.environ.get("QTUNE_BUILD_DIR", "")


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "tests", "acl_standin")), reason="no stand-in built")
def test_npu_check_rehearsal(tmp_path):
    env = dict(os.environ, NPU_CHECK_STANDIN="1", NPU_CHECK_BUILD=BUILD, NPU_CHECK_SKIP="timed", OUT=str(tmp_path))
    env.pop("QTUNE_BACKEND", None)
    p = subprocess.run([os.path.join(SRC, "scripts", "npu-check"), "300"], capture_output=True, text=True, env=env,
                       timeout=600)
    report = (tmp_path / "REPORT.md").read_text()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "REHEARSAL on the CPU stand-in of CANN" in report
    assert "## doctor: exit 0" in report and "hccl " in report
    assert "test_backend_parity npu: exit 0" in report, report
    if shutil.which("mpirun"):
        assert "hccl_check: exit 0" in report and "transport HCCL" in report and "hccl ok" in report, report
    assert "fp32: cpu exit 0" in report and "fp16: cpu exit 0" in report, report
    assert (tmp_path / "logs.tgz").exists()
