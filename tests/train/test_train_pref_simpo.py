"""SimPO on Qwen3 through `qtune train`: 20 LoRA steps against the PyTorch reference
with TRL's CPOTrainer(loss_type="simpo") formulas (test_train_pref.py holds the harness; one case a
file, as each takes minutes on a CPU and ctest allows a file 20)."""
from test_train_pref import check_20_steps, pytestmark  # noqa: F401  (the tokenizer skip)


def test_lora_20_steps_match_trl(tmp_path):
    check_20_steps(tmp_path, "qwen3", {"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5}, "qwen3-simpo")
