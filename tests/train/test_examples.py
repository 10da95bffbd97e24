"""The shipped examples parse and run: examples/lora-1card.json (fp16 dynamic
scaling, clipping, LoRA r8/alpha32/dropout 0.1 on q/v) and
examples/zero2-4rank.json (ZeRO-2 with optimizer offload, 4 MPI ranks, batch
32 = 2 x 4 x 4), each for two steps on the tiny preset with the pre-tokenized
example data (the chat data needs the real tokenizer; scripts/demo runs it).
The token cache goes to the test's temporary folder, never into examples/."""
import json
import os
import shutil
import subprocess

import pytest

from trainutil import QTUNE, SRC, env, init_model, run, step_lines

EX = os.path.join(SRC, "examples")
TOKENS = ["--set", "data.train=data/tokens-train.jsonl", "--set", "data.eval=data/tokens-eval.jsonl",
          "--set", "data.seq_len=32", "--set", "train.max_steps=2", "--set", "train.eval_batches=1"]


def test_lora_1card(tmp_path):
    model = init_model(str(tmp_path / "model"))
    out = str(tmp_path / "run")
    run("train", os.path.join(EX, "lora-1card.json"), "--set", "model=" + model, "--set", "output_dir=" + out,
        "--set", "data.cache_dir=" + str(tmp_path / "cache"), *TOKENS)
    lines = step_lines(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["loss_scale"] == 65536  # fp16, dynamic, initial_scale_power 16
    assert lines[0]["tokens"] == 4 * 4 * 32  # micro 4 x accumulation 4 rows of 32
    cfg = json.load(open(os.path.join(out, "final", "adapter_config.json")))
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["target_modules"]) == (8, 32, 0.1,
                                                                                         ["q_proj", "v_proj"])


@pytest.mark.skipif(not shutil.which("mpirun"), reason="needs mpirun")
def test_zero2_4rank(tmp_path):
    cfg = os.path.join(os.environ.get("QTUNE_BUILD_DIR", ""), "generated", "qtune_config.h")
    if os.path.exists(cfg) and "QTUNE_HAVE_MPI 1" not in open(cfg).read():
        pytest.skip("qtune built without MPI")
    model = init_model(str(tmp_path / "model"))
    out = str(tmp_path / "run")
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", QTUNE, "train",
                        os.path.join(EX, "zero2-4rank.json"), "--set", "model=" + model, "--set", "output_dir=" + out,
                        "--set", "data.cache_dir=" + str(tmp_path / "cache"),
                        *TOKENS],
                       capture_output=True, text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = step_lines(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["tokens"] == 32 * 32  # train_batch_size 32 rows of 32 tokens over 4 ranks
    assert os.path.exists(os.path.join(out, "final", "model.safetensors"))
    state = json.load(open(os.path.join(out, "checkpoint-2", "trainer_state.json")))
    assert state["world"] == 4 and len(state["data_position"]) == 4


def test_examples_write_nothing_into_the_checkout():
    """Every job in examples/ puts its outputs and its token cache (data.cache_dir, else <data folder>/.qtune-cache)
    where git ignores them, and none under examples/: a fresh clone runs them without changing what is tracked."""
    if subprocess.run(["git", "-C", SRC, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("the sources are not a git checkout")
    for name in sorted(os.listdir(EX)):
        if not name.endswith(".json"):
            continue
        job = json.load(open(os.path.join(EX, name)))
        if "output_dir" not in job:
            continue  # a model config (qtune init --config), not a job
        data = job["data"]
        written = [job["output_dir"]]
        if data.get("cache_dir"):
            written.append(data["cache_dir"])
        else:
            for key in ("train", "eval"):
                files = data.get(key) or []
                for f in [files] if isinstance(files, str) else files:
                    written.append(os.path.join(os.path.dirname(f), ".qtune-cache"))
        for w in written:
            path = os.path.normpath(os.path.join(EX, w))
            assert not path.startswith(EX + os.sep), f"{name}: writes {path} inside examples/"
            if path.startswith(SRC + os.sep):
                probe = os.path.join(path, "x")  # a file the run would create there
                ignored = subprocess.run(["git", "-C", SRC, "check-ignore", "-q", probe]).returncode == 0
                assert ignored, f"{name}: {path} is inside the checkout and not git-ignored"
