"""ORPO and SimPO through `qtune train`: 20 LoRA steps against the PyTorch
reference with TRL's ORPOTrainer / CPOTrainer(loss_type="simpo") formulas
(test_train_pref.py holds the harness and DPO)."""
import pytest

from test_train_pref import check_20_steps, pytestmark  # noqa: F401  (the tokenizer skip)

CASES = {"qwen2-orpo": ("qwen2", {"type": "orpo", "beta": 0.2}),
         "qwen3-simpo": ("qwen3", {"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5})}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_20_steps_match_trl(tmp_path, case):
    check_20_steps(tmp_path, *CASES[case], case)
