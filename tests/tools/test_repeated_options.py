"""An option that takes one value, given twice (`--model a --model b`), is a
usage error that names it; every command's parser took the last value in
silence. --set, which is meant to repeat, keeps adding to the list."""
import pytest

from conftest import qtune
from test_help import OPTIONS

# options without a value (a second one changes nothing) and options meant to repeat
FLAGS = {"--force", "--json", "--chat", "--overlap-comm", "--checkpointing", "--strategies", "--no-table", "--wait"}
LISTS = {"--set"}
# values the parser takes, so that only the repeat can be refused
VALUES = {"--seed": ("1", "2"), "--seq-len": ("8", "16"), "--batch": ("1", "2"), "--max-new": ("1", "2"),
          "--ctx": ("8", "16"), "--temperature": ("0", "1"), "--top-p": ("1", "0.5"), "--top-k": ("1", "2"),
          "--zero": ("0", "1"), "--devices": ("1", "2"), "--ranks": ("1", "2"), "--mode": ("lora", "full"),
          "--offload": ("none", "cpu"), "--precision": ("bf16", "fp32"), "--micro-batch": ("1", "2"),
          "--device-memory": ("8", "16"), "--lora-r": ("4", "8"), "--card-watts": ("300", "400"),
          "--host-watts": ("100", "200"), "--cards-per-host": ("1", "2"), "--dataset-gib": ("1", "2"),
          "--reduce-bucket-size": ("1000", "2000"), "--allgather-bucket-size": ("1000", "2000"),
          "--dtype": ("bf16", "f32"), "--device": ("cpu", "auto"), "--backend": ("cpu", "cpu"),
          "--format": ("text", "tokens"), "--modules-to-save": ("lm_head", "embed_tokens")}

CASES = [(cmd, opt) for cmd in sorted(OPTIONS) for opt in OPTIONS[cmd] if opt not in FLAGS | LISTS]


def test_every_command_is_covered():
    assert {cmd for cmd, _ in CASES} == set(OPTIONS) - {"train", "stop"}


@pytest.mark.parametrize("cmd,opt", CASES)
def test_a_repeated_option_is_refused_by_name(cmd, opt):
    a, b = VALUES.get(opt, ("first-value", "second-value"))
    if cmd == "export" and opt == "--dtype":
        a, b = "f16", "f32"
    p = qtune(cmd, opt, a, opt, b)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "%s given twice ('%s' and '%s'); give it once" % (opt, a, b) in p.stderr, p.stderr
    assert p.stderr.startswith("qtune %s: " % cmd) and p.stdout == "", (p.stdout, p.stderr)


def test_the_same_value_twice_is_refused_too():
    p = qtune("merge", "--model", "m", "--model", "m", "--adapter", "a", "--out", "o")
    assert p.returncode == 2 and "--model given twice ('m' and 'm')" in p.stderr, p.stderr


def test_set_still_repeats():
    """plan takes --set again and again (tests/tools/test_plan.py runs two against a job); without a job
    file the --set list is refused for that reason, not as a repeat."""
    p = qtune("plan", "--preset", "tiny", "--set", "lora.r=4", "--set", "lora.r=8")
    assert p.returncode == 2 and "given twice" not in p.stderr and "--set needs a job file" in p.stderr, p.stderr
    p = qtune("doctor", "--set", "lora.r=4", "--set", "lora.r=8")
    assert p.returncode == 2 and "given twice" not in p.stderr and "--set needs a job file" in p.stderr, p.stderr
