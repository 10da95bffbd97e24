"""qtune plan with a 4-bit base (QLoRA): the job's "quantization" key or --quantization; the layer
linears count 0.5 byte a weight plus their absmax (qt_q4_bytes), and the plan predicts the guard backend's
device peak of a real QLoRA run within 10%, as test_plan.py holds the 16-bit strategies."""
import json

import pytest

from conftest import qtune
from test_plan import SHAPES, write_shape_job


@pytest.mark.parametrize("nested", [False, True])
def test_qlora_plan_matches_device_peak(tmp_path, nested):
    SHAPES["qlora"] = SHAPES["lora"]
    try:
        job = write_shape_job(tmp_path, "qlora")
    finally:
        del SHAPES["qlora"]
    job["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": nested}
    (tmp_path / "job.json").write_text(json.dumps(job))
    qtune("train", tmp_path / "job.json", check=0, env={"QTUNE_BACKEND": "guard", "OMP_NUM_THREADS": "1"})
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        lines = [json.loads(l) for l in f if l.strip()]
    measured = max(l.get("device_peak_bytes", 0) for l in lines)
    plan = json.loads(qtune("plan", tmp_path / "job.json", "--device", "guard", "--json", check=0).stdout)
    assert plan["base"] == ("4-bit, double-quantized" if nested else "4-bit")
    predicted = plan["per_device_bytes"]["total"]
    err = (predicted - measured) / measured
    print(f"qlora nested={nested}: planned {predicted / 2**20:.2f} MiB, device peak {measured / 2**20:.2f} MiB "
          f"({err:+.1%})")
    assert abs(err) <= 0.10, f"plan {predicted} vs device peak {measured} ({err:+.1%})\n{plan}"


def test_quantization_option_counts_half_a_byte_a_weight():
    """Qwen2.5-0.5B's shape in bf16: the 4-bit base saves (2 - 0.5 - 4/64) bytes on each layer-linear weight."""
    args = ["plan", "--preset", "qwen2.5-0.5b", "--mode", "lora", "--precision", "bf16", "--json"]
    b16 = json.loads(qtune(*args, check=0).stdout)
    q4 = json.loads(qtune(*args, "--quantization", "nf4", check=0).stdout)
    dq = json.loads(qtune(*args, "--quantization", "nf4", "--double-quant", check=0).stdout)
    L, C, I, KVD = 24, 896, 4864, 128  # q/o C x C, k/v KVD x C, gate/up/down I x C
    n = L * (2 * C * C + 2 * KVD * C + 3 * I * C)
    saved = b16["per_device_bytes"]["weights"] - q4["per_device_bytes"]["weights"]
    assert abs(saved - n * (2 - 0.5 - 4 / 64)) < 0.001 * n, (saved, n)
    assert dq["per_device_bytes"]["weights"] < q4["per_device_bytes"]["weights"]
    assert b16["base"] == "16-bit" and q4["base"] == "4-bit"
    p = qtune("plan", "--preset", "tiny", "--quantization", "int8")
    assert p.returncode != 0 and "--quantization must be nf4, fp4 or none" in p.stderr


def test_strategies_table_has_qlora_under_20_gb():
    """The field report's "under 20 GB" LoRA row is reproduced by QLoRA: Qwen-14B, r 8 on c_attn, B 1 x T 512,
    recomputation, fp16 compute, NF4 base."""
    out = qtune("plan", "--preset", "qwen-14b", "--checkpointing", "--strategies", check=0).stdout
    assert "QLoRA 1 card" in out
    total = [l for l in out.splitlines() if l.startswith("total")][0].split()
    lora, qlora = float(total[3]), float(total[4])
    assert qlora < 20 * 1e9 / 2**30 < lora, out


def test_skip_modules_stay_16bit_in_the_plan(tmp_path):
    """llm_int8_skip_modules: the named linears keep their 16-bit bytes (lm_head is 16-bit anyway)."""
    SHAPES["qlora"] = SHAPES["lora"]
    try:
        job = write_shape_job(tmp_path, "qlora")
    finally:
        del SHAPES["qlora"]
    sizes = []
    for skip in (None, ["lm_head"], ["down_proj", "lm_head"]):
        job["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "llm_int8_skip_modules": skip}
        (tmp_path / "job.json").write_text(json.dumps(job))
        sizes.append(json.loads(qtune("plan", tmp_path / "job.json", "--json", check=0).stdout)
                     ["per_device_bytes"]["weights"])
    c = SHAPES["lora"][0]
    down = c["num_hidden_layers"] * c["intermediate_size"] * c["hidden_size"]
    assert sizes[0] == sizes[1]
    # the file is f32 (torch_dtype float32): a skipped weight counts 4 bytes instead of 0.5 + absmax
    assert abs((sizes[2] - sizes[0]) - down * (4 - 0.5 - 4 / 64)) < 0.01 * down, sizes
