"""ORPO on Qwen2 through `qtune train`: 20 LoRA steps against the PyTorch reference
with TRL's ORPOTrainer formulas (test_train_pref.py holds the harness; one case a
file, as each takes minutes on a CPU and ctest allows a file 20)."""
from test_train_pref import check_20_steps, pytestmark  # noqa: F401  (the tokenizer skip)


def test_lora_20_steps_match_trl(tmp_path):
    check_20_steps(tmp_path, "qwen2", {"type": "orpo", "beta": 0.2}, "qwen2-orpo")
