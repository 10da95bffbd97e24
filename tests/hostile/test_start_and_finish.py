"""What a run writes at its start and what it leaves undone at its end
(docs/robustness.md, "Start-up and finish"):

- a finished run survives a restart with overwrite_output_dir or resume
  "never" that then fails on its data, model or settings: the old run is
  removed only when the first step is about to start;
- a start that fails on a typo writes nothing, so the corrected command is not
  refused as "a different job"; the temporaries a kill leaves in a new folder
  do not claim it either;
- a rerun after a kill right after the last checkpoint does the final eval,
  the pruning and final/ that were left, and removes the temporaries."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from hostile_util import QTUNE, env, expect_error, ok, run, write, write_job, write_tokens

SRC_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("startfinish")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    write_tokens(d / "tokens.jsonl", n=16)
    write_tokens(d / "eval.jsonl", n=6, seed=5)
    return d


@pytest.fixture
def w(base, tmp_path):
    """A folder of its own: a copy of the model and the data to break."""
    shutil.copytree(base / "model", tmp_path / "model")
    shutil.copy(base / "tokens.jsonl", tmp_path / "tokens.jsonl")
    shutil.copy(base / "eval.jsonl", tmp_path / "eval.jsonl")
    return tmp_path


def snapshot(out):
    """Every file under out with its bytes."""
    snap = {}
    for root, _, files in os.walk(out):
        for f in files:
            p = os.path.join(root, f)
            snap[os.path.relpath(p, out)] = open(p, "rb").read()
    return snap


def checkpoints(out):
    return sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-") and n[11:].isdigit())


def leftovers(out):
    return sorted(n for n in os.listdir(out) if ".tmp" in n or n.endswith(".old"))


def evals(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if "eval_loss" in l]


# ---------------------------------------------------------------------------
# faults a start can meet, each applied to the folder in place (so that the
# job's fingerprint stays the same where it can) or through --set

def break_data(w):
    with open(w / "tokens.jsonl", "a") as f:
        f.write('{"input_ids": [1, 2, \n')
    return []


def drop_model_file(w):
    os.rename(w / "model" / "model.safetensors", w / "model" / "gone.safetensors")
    return []


def missing_shard(w):
    """A sharded model whose index names a shard that is not there."""
    import st
    names = sorted(st.read(str(w / "model" / "model.safetensors")))
    os.rename(w / "model" / "model.safetensors", w / "model" / "model-00001-of-00002.safetensors")
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm[names[0]] = "model-00002-of-00002.safetensors"
    write(w / "model" / "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": wm}))
    return []


def unsupported_model(w):
    cfg = json.load(open(w / "model" / "config.json"))
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    write(w / "model" / "config.json", json.dumps(cfg))
    return []


def seq_len_too_long(w):
    return ["--set", "data.seq_len=1000000"]


def bf16_on_this_cpu(w):
    if "avx512_bf16" in open("/proc/cpuinfo").read():
        pytest.skip("this CPU runs bf16: the hardware refusal cannot be shown here")
    return ["--set", "deepspeed.bf16.enabled=true"]


def bad_resume_path(w):
    return ["--set", "train.resume=%s" % (w / "no-such-checkpoint")]


FAULTS = {"broken_jsonl": break_data, "missing_model_file": drop_model_file, "missing_shard": missing_shard,
          "unsupported_model": unsupported_model, "seq_len_too_long": seq_len_too_long, "bf16": bf16_on_this_cpu}


@pytest.mark.parametrize("mode", ["overwrite_output_dir=true", "resume=never"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_finished_run_survives_a_restart_that_fails(w, mode, fault):
    """Issue 24 item 1: overwrite_output_dir / resume "never" used to remove the
    previous checkpoints and final/ before the model, data and hardware were
    checked. Now a failing restart leaves every byte of the folder as it was."""
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl",
                  train_opts={"max_steps": 2, "save_steps": 1}, data_opts={"eval": "eval.jsonl"})
    ok(["train", j])
    out = w / "out"
    before = snapshot(out)
    assert checkpoints(out) == [1, 2] and "final/model.safetensors" in before
    extra = FAULTS[fault](w)
    expect_error(["train", j, "--set", "train." + mode] + extra)
    assert snapshot(out) == before


@pytest.mark.parametrize("typo", sorted(FAULTS) + ["model_path", "data_path", "bad_resume_path"])
def test_a_start_that_fails_writes_nothing(w, typo):
    """Issue 24 item 2: a train that failed on a wrong model or data path, a
    missing shard, a seq_len too long or an unsupported model had already
    written qtune_run.json, and the corrected command was refused as "a
    different job". Now the folder is not even created, and the corrected
    command runs."""
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl", train_opts={"max_steps": 1})
    if typo == "model_path":
        extra = ["--set", "model=%s" % (w / "modle")]
    elif typo == "data_path":
        extra = ["--set", "data.train=%s" % (w / "tokens.jsnol")]
    elif typo == "bad_resume_path":
        extra = bad_resume_path(w)
    else:
        saved = w / "saved"
        shutil.copytree(w / "model", saved / "model")
        shutil.copy(w / "tokens.jsonl", saved / "tokens.jsonl")
        extra = FAULTS[typo](w)
    expect_error(["train", j] + extra)
    assert not os.path.exists(w / "out"), os.listdir(w / "out")
    if typo not in ("model_path", "data_path", "bad_resume_path") and not extra:
        shutil.rmtree(w / "model")
        shutil.copytree(saved / "model", w / "model")
        shutil.copy(saved / "tokens.jsonl", w / "tokens.jsonl")
    r = ok(["train", j])
    assert "trained 1 steps" in r.stdout


@pytest.mark.parametrize("left", [
    {"qtune_run.json.tmp.4242": '{\n\t"fingerprint":\t"00ab'},
    {"qtune_run.json.tmp.4242": "", "metrics.jsonl.tmp.4242": '{"step": 1', "loss.svg.tmp.4242": "<svg"},
    {"qtune_run.json.tmp.4242": "", "report.html.tmp.4242": "<!DOCTYPE html>"},
])
def test_a_kill_during_the_first_record_does_not_claim_the_folder(w, left):
    """Issue 24 item 2: a kill while qtune_run.json was first written leaves
    only its temporary (qt_write_file_atomic writes NAME.tmp.PID, then renames);
    that folder was refused forever as holding "files that no qtune run wrote".
    Now such temporaries count as nothing, and the start removes them."""
    os.makedirs(w / "out")
    for name, text in left.items():
        write(w / "out" / name, text)
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl", train_opts={"max_steps": 1})
    ok(["train", j])
    assert leftovers(w / "out") == []
    assert json.load(open(w / "out" / "qtune_run.json"))["pid"] > 0


# ---------------------------------------------------------------------------
# a kill right after the last checkpoint

def test_rerun_finishes_what_a_kill_after_the_last_checkpoint_left(w):
    """Issue 24 item 6: the folder as a kill right after checkpoint-4 was
    committed leaves it (no final eval, no final/, the pruning not done, the
    temporaries of writes in flight). The rerun used to write final/ and
    nothing else; now it evaluates step 4 once (the same loss as the
    uninterrupted run, to 1e-6 relative), prunes to save_total_limit, writes the
    same final/ and removes every temporary."""
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl",
                  train_opts={"max_steps": 4, "save_steps": 1, "save_total_limit": 0},
                  data_opts={"eval": "eval.jsonl"})
    ok(["train", j])
    out = w / "out"
    want_eval = [e for e in evals(out) if e["step"] == 4]
    assert len(want_eval) == 1
    final = open(out / "final" / "model.safetensors", "rb").read()
    # the kill: the final eval's line, final/ and the prune never happened
    lines = [l for l in open(out / "metrics.jsonl") if not ('"eval_loss"' in l and json.loads(l)["step"] == 4)]
    write(out / "metrics.jsonl", "".join(lines))
    shutil.rmtree(out / "final")
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-4.tmp")
    os.remove(out / "checkpoint-4.tmp" / "trainer_state.json")
    os.makedirs(out / "final.tmp")
    write(out / "loss.svg.tmp.99999", "<svg")
    write(out / "metrics.jsonl.tmp.99999", "{")
    r = ok(["train", j, "--set", "train.save_total_limit=2"])
    got = [e for e in evals(out) if e["step"] == 4]
    assert len(got) == 1, evals(out)
    assert abs(got[0]["eval_loss"] - want_eval[0]["eval_loss"]) <= 1e-6 * abs(want_eval[0]["eval_loss"])
    assert "eval loss %.4f" % want_eval[0]["eval_loss"] in r.stdout
    assert checkpoints(out) == [3, 4]
    assert leftovers(out) == []
    assert open(out / "final" / "model.safetensors", "rb").read() == final
    # started once more, the finished run evaluates nothing again
    ok(["train", j, "--set", "train.save_total_limit=2"])
    assert len([e for e in evals(out) if e["step"] == 4]) == 1


def test_a_checkpoint_caught_mid_replacement_is_put_back(w):
    """A kill between the two renames that replace a checkpoint (checkpoint-N
    moved to checkpoint-N.old, the new copy still checkpoint-N.tmp) leaves
    checkpoint-N.old as the only whole copy: the next start puts it back and
    resumes from it, instead of going back to checkpoint-N-1 and leaving the
    .old behind."""
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl", train_opts={"max_steps": 2, "save_steps": 1})
    ok(["train", j])
    out = w / "out"
    want = snapshot(out / "checkpoint-2")
    os.rename(out / "checkpoint-2", out / "checkpoint-2.old")
    shutil.copytree(out / "checkpoint-2.old", out / "checkpoint-2.tmp")
    r = ok(["train", j])
    assert "checkpoint-2 is at step 2" in r.stderr, r
    assert snapshot(out / "checkpoint-2") == want
    assert leftovers(out) == []


def test_sigkill_after_the_last_checkpoint_then_rerun(w):
    """The same with a real SIGKILL: sent as soon as checkpoint-3 is complete,
    while the final eval over a large eval set runs. Wherever the kill lands
    after that point, the rerun ends with one eval line for step 3, final/ and
    no temporaries."""
    write_tokens(w / "big_eval.jsonl", n=4000, seed=9)
    j = write_job(w / "job.json", "model", "out", "tokens.jsonl",
                  train_opts={"max_steps": 3, "save_steps": 1, "save_total_limit": 1},
                  data_opts={"eval": "big_eval.jsonl"})
    out = w / "out"
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env())
    state = out / "checkpoint-3" / "trainer_state.json"
    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None and not state.exists():
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert state.exists()
    ok(["train", j])
    assert len([e for e in evals(out) if e["step"] == 3]) == 1, evals(out)
    assert os.path.exists(out / "final" / "model.safetensors")
    assert checkpoints(out) == [3]
    assert leftovers(out) == []
