"""scripts/npu-check rehearsed on the CPU stand-in of CANN (NPU_CHECK_STANDIN=1, this build): every step runs
to its end and lands in REPORT.md: the doctor's Ascend rows, op parity on the ops CTest runs, HCCL at 2 ranks,
the 20-step runs fp32 and fp16 on the NPU against the CPU (20 steps each, their losses compared and within
test_npu_train's 1e-4), and the timed case (the rehearsal's tiny shape: 20 steps and a tokens/s figure)."""
import re
import os
import shutil
import subprocess

import pytest

from conftest import SRC

BUILD = os.environ.get("QTUNE_BUILD_DIR", "")


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "tests", "acl_standin")), reason="no stand-in built")
def test_npu_check_rehearsal(tmp_path):
    env = dict(os.environ, NPU_CHECK_STANDIN="1", NPU_CHECK_BUILD=BUILD, OUT=str(tmp_path))
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
    assert "fp32: cpu exit 0, npu exit 0" in report and "fp16: cpu exit 0, npu exit 0" in report, report
    worst = [float(w) for w in re.findall(r"20 steps: .* worst relative difference (\S+)", report)]
    assert len(worst) == 2 and max(worst) <= 1e-4, report
    assert "## timed: 20 LoRA fp16 steps of the tiny shape" in report, report
    assert re.search(r"exit 0, 20 steps, tokens/s at the last step: [0-9.]+", report), report
    assert (tmp_path / "logs.tgz").exists()
