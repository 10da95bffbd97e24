"""Issue 45, items 3 and 4: `qtune plan --device npu` from the Atlas 300T A2's descriptor (32 GB HBM, 140 TFLOP/s
fp16, no bf16, as the field report gives them), refusing bf16 in one sentence; `qtune doctor`'s Ascend rows from
the report's failure table (driver status through `npu-smi info`, the CANN version its RoPE operator needs, the
HCCL timeouts and whitelist, the PCIe link), each problem with its fix, read here from a fake npu-smi on PATH, a
fake CANN install record and a fake sysfs; on a machine with none of them the rows say so and warn of nothing."""
import json
import os
import stat

from conftest import qtune

NPU_SMI = """#!/bin/sh
cat <<'TABLE'
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.4        38                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 32768         |
+===========================+===============+====================================================+
| 1     910B3               | Alarm         | 90.1        41                0    / 0             |
| 0                         | 0000:81:00.0  | 0           0    / 0          3161 / 32768         |
+===========================+===============+====================================================+
TABLE
"""

HCCL_VARS = ["HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_WHITELIST_DISABLE", "HCCL_WHITELIST_FILE",
             "HCCL_P2P_DISABLE", "HCCL_P2P_LEVEL", "QTUNE_DIST_TIMEOUT"]


def doctor(env, unset=()):
    e = dict(os.environ)
    for k in unset:
        e.pop(k, None)
    e.update(env)
    import subprocess
    return subprocess.run([os.environ["QTUNE_BIN"], "doctor", "--no-table"], capture_output=True, text=True, env=e,
                          timeout=120)


def fake_machine(tmp_path, cann="8.1.RC1", width=(16, 16)):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "npu-smi"
    smi.write_text(NPU_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    toolkit = tmp_path / "toolkit"
    (toolkit / "x86_64-linux").mkdir(parents=True)
    (toolkit / "x86_64-linux" / "ascend_toolkit_install.info").write_text(f"package_name=Ascend-cann-toolkit\n"
                                                                          f"version={cann}\n")
    sysfs = tmp_path / "pci"
    for bus, (w, wmax) in (("0000:c1:00.0", (16, 16)), ("0000:81:00.0", width)):
        d = sysfs / bus
        d.mkdir(parents=True)
        for name, v in (("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe"),
                        ("current_link_width", str(w)), ("max_link_width", str(wmax))):
            (d / name).write_text(v + "\n")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ASCEND_HOME_PATH": str(toolkit), "QTUNE_SYSFS_PCI": str(sysfs)}


def all_unset():
    return HCCL_VARS + ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"]


def test_plan_npu_is_the_atlas_card():
    p = qtune("plan", "--preset", "qwen2.5-0.5b", "--device", "npu", "--precision", "fp16", "--json", check=0)
    r = json.loads(p.stdout)
    assert r["backend"] == "npu"
    assert r["card"]["name"] == "Atlas 300T A2" and r["card"]["hbm_gib"] == 32 and r["card"]["fp16_tflops"] == 140
    assert r["card"]["bf16"] is False
    assert r["device_memory_bytes"] == 32 * 1024 ** 3
    text = qtune("plan", "--preset", "qwen2.5-0.5b", "--device", "npu", check=0).stdout
    assert "card       Atlas 300T A2: 32 GiB HBM, 140 TFLOP/s fp16, no bf16" in text, text
    assert "Atlas" not in qtune("plan", "--preset", "qwen2.5-0.5b", "--device", "cuda", check=0).stdout


def test_plan_npu_refuses_bf16_in_one_sentence():
    p = qtune("plan", "--preset", "qwen2.5-0.5b", "--device", "npu", "--precision", "bf16")
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "Atlas 300T A2" in err and "no bf16" in err and "--precision fp16" in err, err
    assert len(err.splitlines()) == 1, err
    assert qtune("plan", "--preset", "qwen2.5-0.5b", "--device", "cuda", "--precision", "bf16").returncode == 0


def test_doctor_without_npu_says_so_and_warns_of_nothing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    p = doctor({"PATH": f"{empty}:/usr/bin:/bin"}, unset=all_unset())
    assert "npu        npu-smi not found" in p.stdout, p.stdout
    assert "cann       no CANN toolkit found" in p.stdout
    assert "HCCL is not used on this machine" in p.stdout
    npu_part = p.stdout[p.stdout.index("npu        "):p.stdout.index("memory")]
    assert "warning" not in npu_part, npu_part


def test_doctor_reads_npu_smi_cann_and_pcie(tmp_path):
    p = doctor(fake_machine(tmp_path, cann="8.0.RC2", width=(8, 16)), unset=all_unset())
    out = p.stdout
    assert "npu        driver 23.0.6 (npu-smi info); 2 cards" in out, out
    assert "npu 0  910B3  health OK" in out and "npu 1  910B3  health Alarm" in out
    assert "warning: npu 1 reports health Alarm" in out and "npu-smi info -t health -i 1" in out
    assert "npu 0 PCIe 0000:c1:00.0: x16 at 16.0 GT/s, 31.5 GB/s" in out, out
    assert "warning: npu 1's PCIe link runs at 50% of its bandwidth" in out and "x16 slot" in out
    assert "cann       8.0.RC2" in out
    assert "warning: CANN 8.0.RC2 is older than 8.1.RC1" in out and "RoPE" in out
    # a healthy machine: no warnings in these rows
    good = tmp_path / "good"
    good.mkdir()
    out = doctor(fake_machine(good), unset=all_unset()).stdout
    assert "cann       8.1.RC1" in out and "older than" not in out and "PCIe link runs" not in out


def test_doctor_hccl_settings(tmp_path):
    env = fake_machine(tmp_path)
    out = doctor(env, unset=all_unset()).stdout
    assert "HCCL_CONNECT_TIMEOUT 120 s (unset: HCCL's default), HCCL_EXEC_TIMEOUT 1836 s" in out, out
    assert "IP whitelist off" in out
    bad = dict(env, HCCL_CONNECT_TIMEOUT="30", HCCL_EXEC_TIMEOUT="100", QTUNE_DIST_TIMEOUT="600",
               HCCL_WHITELIST_DISABLE="0", HCCL_P2P_LEVEL="PIX")
    out = doctor(bad, unset=all_unset()).stdout
    assert "warning: HCCL_CONNECT_TIMEOUT='30' is outside HCCL's range of 120 to 7200 seconds" in out, out
    assert "warning: HCCL_EXEC_TIMEOUT (100 s) ends a stalled collective before qtune's deadline (600 s)" in out
    assert "HCCL_WHITELIST_FILE is unset" in out and "HCCL_WHITELIST_DISABLE=1" in out
    assert "HCCL_P2P_LEVEL PIX" in out and "NCCL's name" in out
    wl = tmp_path / "whitelist.json"
    wl.write_text('{"host_ip": ["10.0.0.1"]}')
    out = doctor(dict(env, HCCL_WHITELIST_DISABLE="0", HCCL_WHITELIST_FILE=str(wl)), unset=all_unset()).stdout
    assert f"IP whitelist on (HCCL_WHITELIST_DISABLE=0): {wl}" in out, out
