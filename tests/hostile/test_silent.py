"""Wrong results in silence (issue 24, items 7, 8, 10 and 11; docs/robustness.md): what used to train
on, resume or report success without a word now stops with one sentence naming the file, key or tensor.

- non-finite weights never reach a checkpoint: an update that makes a weight NaN/inf is a failed step
  that nothing saves, and the error names a checkpoint that really is good; a NaN in a resumed
  optimizer part or weight file is refused, naming the file; eps <= 0 is refused, naming the key;
- every checkpoint (and final/) carries checksums.sha256: flipped bits, files swapped in from another
  checkpoint, a trainer_state.json whose step disagrees with its folder or whose applied_updates
  exceed its step are refused, naming the file and the previous checkpoint to resume from; an old
  checkpoint without the file resumes with a warning;
- a run whose every step was skipped fails; skipped steps are reported;
- a negative learning rate through the scheduler, duplicate keys in a job or DeepSpeed file, a
  checkpoint tensor the model does not have and a model folder's unused tensor are refused."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from hostile_util import expect_error, ok, run, write, write_job, write_tokens

import st  # tests/ref, put on the path by hostile_util

LORA = {"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("silent")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1"])
    write_tokens(d / "tokens.jsonl", n=16)
    return d


def finite_folder(ck):
    """Every tensor of every safetensors file in ck is finite."""
    for name in os.listdir(ck):
        if name.endswith(".safetensors"):
            for k, v in st.read(os.path.join(ck, name)).items():
                assert np.isfinite(v).all(), (ck, name, k)


def checkpoints(out):
    return sorted(int(n.split("-")[1]) for n in os.listdir(out)
                  if n.startswith("checkpoint-") and not n.endswith(".tmp"))


def rewrite_sums(ck):
    """Recomputes checksums.sha256 as a careful forger (or an old bug) would: shows that the check
    behind the checksum still holds on its own."""
    lines = []
    for name in sorted(os.listdir(ck)):
        if name != "checksums.sha256":
            lines.append("%s  %s\n" % (hashlib.sha256(open(os.path.join(ck, name), "rb").read()).hexdigest(), name))
    write(os.path.join(ck, "checksums.sha256"), "".join(lines))


def trained(base, name, steps=3, lora=None):
    """A finished run of `steps` steps, a checkpoint at each; returns (job, out)."""
    out = base / ("out_" + name)
    j = write_job(base / (name + ".json"), "model", out.name, "tokens.jsonl", lora=lora,
                  train_opts={"max_steps": steps, "save_steps": 1}, ds=DS)
    ok(["train", j])
    return j, out


# ---------------------------------------------------------------------------
# item 7: non-finite weights

def test_eps_zero_is_refused_naming_the_key(base):
    ds = dict(DS, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "eps": 0}})
    j = write_job(base / "eps.json", "model", "out_eps", "tokens.jsonl", ds=ds)
    expect_error(["train", j], "optimizer.params", "eps 0", "> 0")
    assert not os.path.exists(base / "out_eps" / "checkpoint-1")


@pytest.mark.parametrize("lr", [1e38, 3e38])
def test_an_update_that_overflows_is_a_failed_step_that_nothing_saves(base, lr):
    """lr 1e38 makes Adam's step size (lr / (1 - beta1)) overflow fp32 at step 1: before, the inf/NaN
    weights were saved as checkpoint-1 and step 2's error named it 'the last good checkpoint'."""
    ds = dict(DS, optimizer={"type": "AdamW", "params": {"lr": lr}})
    out = base / ("out_big_%g" % lr)
    j = write_job(base / "big.json", "model", out.name, "tokens.jsonl", train_opts={"max_steps": 4, "save_steps": 1},
                  ds=ds)
    expect_error(["train", j], "step 1", "non-finite", "model.", "no checkpoint was written yet")
    assert checkpoints(out) == []


def test_the_named_last_good_checkpoint_is_finite(base):
    """A run that blows up after good steps names the newest checkpoint, which holds finite values
    (before, the checkpoint of the step that overflowed was saved and named as good)."""
    # WarmupLR from 0 to 3e38 over 3 steps: updates 1 and 2 run with lr 0 (DeepSpeed's lr(-1) and
    # lr(0)), update 3 with 1e38, whose step size 1e38 / (1 - 0.9^3) overflows fp32. Before,
    # checkpoint-3 was saved with inf weights and step 4's error named it as good.
    ds = dict(DS, optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
              scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e38,
                                                        "warmup_num_steps": 3, "warmup_type": "linear"}})
    out = base / "out_warm_big"
    j2 = write_job(base / "warm_big.json", "model", out.name, "tokens.jsonl",
                   train_opts={"max_steps": 6, "save_steps": 1}, ds=ds)
    r = expect_error(["train", j2], "step 3", "non-finite", "the last good checkpoint is")
    named = r.stderr.strip().splitlines()[-1].rsplit("the last good checkpoint is ", 1)[1].strip()
    assert os.path.basename(named) == "checkpoint-2" and checkpoints(out) == [1, 2], r
    for s in checkpoints(out):
        finite_folder(out / ("checkpoint-%d" % s))


@pytest.mark.parametrize("tensor", ["exp_avg", "exp_avg_sq"])
def test_nan_in_a_resumed_optimizer_part_is_refused(base, tensor):
    """Even with checksums that match (recomputed after the edit), a NaN in Adam's state is refused
    naming the file and the tensor, and the previous checkpoint to resume from."""
    j, out = trained(base, "opt_nan_" + tensor)
    ck = out / "checkpoint-3"
    path = ck / "optimizer-00000-of-00001.safetensors"
    # the value rewritten in place: same header, so the part's metadata (range, numel) stays right
    raw = bytearray(open(path, "rb").read())
    hlen = int.from_bytes(raw[:8], "little")
    off = 8 + hlen + json.loads(raw[8:8 + hlen])[tensor]["data_offsets"][0] + 7 * 4
    raw[off:off + 4] = np.array([np.nan if tensor == "exp_avg" else -1.0], dtype="<f4").tobytes()
    open(path, "wb").write(bytes(raw))
    rewrite_sums(ck)
    expect_error(["train", j, "--set", "train.max_steps=5"], "optimizer-00000-of-00001.safetensors", tensor,
                 "checkpoint-2")
    assert checkpoints(out) == [1, 2, 3]


def test_nan_in_resumed_weights_is_refused(base):
    j, out = trained(base, "w_nan")
    ck = out / "checkpoint-3"
    w = st.read(str(ck / "model.safetensors"))
    k = sorted(w)[0]
    w[k] = w[k].copy()
    w[k].flat[3] = np.inf
    st.write(str(ck / "model.safetensors"), w, "F32")
    rewrite_sums(ck)
    expect_error(["train", j, "--set", "train.max_steps=5"], "model.safetensors", k, "NaN or infinite",
                 "checkpoint-2")


# ---------------------------------------------------------------------------
# item 8: checksums and cross-checks

def test_checkpoints_and_final_carry_checksums_that_sha256sum_accepts(base):
    j, out = trained(base, "sums", steps=2)
    for ck in ("checkpoint-1", "checkpoint-2", "final"):
        lines = open(out / ck / "checksums.sha256").read().splitlines()
        names = sorted(n for n in os.listdir(out / ck) if n != "checksums.sha256")
        assert [l.split("  ", 1)[1] for l in lines] == names
        for l in lines:
            h, n = l.split("  ", 1)
            assert hashlib.sha256(open(out / ck / n, "rb").read()).hexdigest() == h, (ck, n)
    # resuming a good checkpoint says nothing about checksums
    r = ok(["train", j, "--set", "train.max_steps=3"])
    assert "checksum" not in r.stderr


def test_a_flipped_bit_in_a_tensor_is_refused_naming_the_file_and_the_previous_checkpoint(base):
    j, out = trained(base, "flip")
    path = out / "checkpoint-3" / "model.safetensors"
    raw = bytearray(open(path, "rb").read())
    raw[-100] ^= 0x04  # a low mantissa bit: the value stays finite and plausible
    open(path, "wb").write(bytes(raw))
    r = expect_error(["train", j, "--set", "train.max_steps=5"], "checkpoint-3/model.safetensors", "SHA-256",
                     "out_flip/checkpoint-2", "train.resume")
    assert checkpoints(out) == [1, 2, 3] and "step 4" not in r.stderr
    # the named checkpoint resumes
    ok(["train", j, "--set", "train.max_steps=5", "--set", "train.resume=%s" % (out / "checkpoint-2")])


def test_a_file_swapped_in_from_another_checkpoint_is_refused(base):
    j, out = trained(base, "swap")
    shutil.copy(out / "checkpoint-2" / "optimizer-00000-of-00001.safetensors",
                out / "checkpoint-3" / "optimizer-00000-of-00001.safetensors")
    expect_error(["train", j, "--set", "train.max_steps=5"], "checkpoint-3/optimizer-00000-of-00001.safetensors",
                 "SHA-256", "checkpoint-2")


def test_the_oldest_checkpoint_damaged_says_there_is_none_to_go_back_to(base):
    j, out = trained(base, "first", steps=1)
    write(out / "checkpoint-1" / "config.json", "{}")
    expect_error(["train", j, "--set", "train.max_steps=3"], "checkpoint-1/config.json", "no earlier checkpoint",
                 'train.resume "never" starts over')


@pytest.mark.parametrize("field,value,must", [
    ("step", 4, "says step 4 but its folder is checkpoint-3"),
    ("applied_updates", 1e15, "applied_updates"),
])
def test_state_fields_that_disagree_are_refused(base, field, value, must):
    """Cross-checks that hold with or without checksums (here the sums are recomputed after the edit)."""
    j, out = trained(base, "field_" + field)
    ck = out / "checkpoint-3"
    s = json.load(open(ck / "trainer_state.json"))
    s[field] = value
    write(ck / "trainer_state.json", json.dumps(s, indent=1))
    rewrite_sums(ck)
    expect_error(["train", j, "--set", "train.max_steps=5"], "trainer_state.json", must, "checkpoint-2")


def test_an_old_checkpoint_without_checksums_resumes_with_a_warning(base):
    j, out = trained(base, "old", steps=2)
    os.remove(out / "checkpoint-2" / "checksums.sha256")
    r = ok(["train", j, "--set", "train.max_steps=3"])
    assert "checkpoint-2 has no checksums.sha256" in r.stderr and "without being checked" in r.stderr, r
    # and what it writes from then on has them
    assert os.path.exists(out / "checkpoint-3" / "checksums.sha256")


def test_a_damaged_checksum_file_is_refused(base):
    j, out = trained(base, "badsums", steps=2)
    write(out / "checkpoint-2" / "checksums.sha256", "not a checksum line\n")
    expect_error(["train", j, "--set", "train.max_steps=3"], "checksums.sha256 line 1", "checkpoint-1")


def test_a_listed_file_that_is_missing_is_refused(base):
    j, out = trained(base, "missing", steps=2)
    os.remove(out / "checkpoint-2" / "config.json")
    expect_error(["train", j, "--set", "train.max_steps=3"], "checkpoint-2/config.json is missing", "checkpoint-1")


# ---------------------------------------------------------------------------
# item 10: a run that learned nothing

def test_every_step_skipped_is_a_failure(base):
    """A static fp16 loss scale of 2^40 overflows every step: before, 'trained 3 steps', exit 0, and a
    final/ that is the untouched base model."""
    ds = dict(DS, fp16={"enabled": True, "loss_scale": 2 ** 40})
    out = base / "out_fp16"
    j = write_job(base / "fp16.json", "model", out.name, "tokens.jsonl", train_opts={"max_steps": 3}, ds=ds)
    r = expect_error(["train", j], "every one of the 3 steps was skipped", "3 fp16 overflows", "fp16.loss_scale")
    assert "trained" not in r.stdout
    assert not os.path.exists(out / "final")


def test_skipped_steps_are_reported(base):
    """A dynamic scale that starts at 2^40 skips its first steps, then trains: the run succeeds and
    says how many steps applied no update."""
    ds = dict(DS, fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 40, "hysteresis": 1})
    out = base / "out_fp16_some"
    j = write_job(base / "fp16_some.json", "model", out.name, "tokens.jsonl", train_opts={"max_steps": 40}, ds=ds)
    r = ok(["train", j])
    state = json.load(open(out / "checkpoint-40" / "trainer_state.json"))
    skipped = 40 - state["applied_updates"]
    assert 0 < skipped < 40, state
    assert "(%d skipped: no update)" % skipped in r.stdout, r
    assert "%d of 40 steps were skipped (%d fp16 overflows, 0 without a labelled token)" % (skipped, skipped) in r.stderr


# ---------------------------------------------------------------------------
# item 11: refused instead of ignored

@pytest.mark.parametrize("sched,must", [
    ({"type": "WarmupLR", "params": {"warmup_max_lr": -1}}, "warmup_max_lr -1"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -1e-5, "warmup_max_lr": 1e-3}}, "warmup_min_lr"),
    ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": -0.001, "total_num_steps": 10}}, "warmup_max_lr"),
    ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": -0.001, "total_num_steps": "auto"}}, "warmup_max_lr"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": -2}}, "cos_min_ratio"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_ratio": -1}}, "warmup_min_ratio"),
])
def test_a_negative_learning_rate_through_the_scheduler_is_refused(base, sched, must):
    ds = dict(DS, scheduler=sched)
    out = "out_neg_%s_%s" % (sched["type"], must.split()[0])
    j = write_job(base / (out + ".json"), "model", out, "tokens.jsonl", ds=ds)
    expect_error(["train", j], "scheduler.params." + must, "must be")
    assert not os.path.exists(base / out / "checkpoint-1")


def test_duplicate_keys_in_a_job_file_are_refused(base):
    text = ('{"model": "model", "output_dir": "out_dup", "data": {"train": "tokens.jsonl", "seq_len": 8},\n'
            ' "train": {"max_steps": 2, "seed": 7, "max_steps": 1000}}')
    write(base / "dup.json", text)
    expect_error(["train", base / "dup.json"], "dup.json", '"train.max_steps"', "more than once")
    write(base / "dup_top.json", text[:-1] + ', "model": "elsewhere"}')
    expect_error(["train", base / "dup_top.json"], "dup_top.json", '"model"', "more than once")


def test_duplicate_keys_in_a_deepspeed_file_are_refused(base):
    write(base / "ds_dup.json", '{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,\n'
                                ' "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "lr": 1e-2}}}')
    j = write_job(base / "dsdup.json", "model", "out_dsdup", "tokens.jsonl", ds="ds_dup.json")
    expect_error(["train", j], "ds_dup.json", '"optimizer.params.lr"', "more than once")


def test_a_checkpoint_tensor_the_model_does_not_have_is_refused(base):
    j, out = trained(base, "extra_ck", steps=2, lora=LORA)
    ck = out / "checkpoint-2"
    w = st.read(str(ck / "adapter_model.safetensors"))
    name = sorted(w)[0].replace("q_proj", "k_proj")
    assert name not in w
    w[name] = np.zeros_like(w[sorted(w)[0]])
    st.write(str(ck / "adapter_model.safetensors"), w, "F32")
    rewrite_sums(ck)
    expect_error(["train", j, "--set", "train.max_steps=3"], "adapter_model.safetensors", name,
                 "does not have", "checkpoint-1")


def test_a_model_folder_tensor_the_architecture_does_not_use_is_refused(base):
    """Qwen3's per-head q_norm in a folder whose config.json says Qwen2 (or Llama): before, ignored."""
    shutil.copytree(base / "model", base / "model_qnorm")
    path = str(base / "model_qnorm" / "model.safetensors")
    w = st.read(path)
    w["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, dtype=np.float32)
    st.write(path, w, "F32")
    j = write_job(base / "qnorm.json", "model_qnorm", "out_qnorm", "tokens.jsonl", ds=DS)
    expect_error(["train", j], "model.layers.0.self_attn.q_norm.weight", "does not use")
    j = write_job(base / "qnorm_lora.json", "model_qnorm", "out_qnorm_lora", "tokens.jsonl", lora=LORA, ds=DS)
    expect_error(["train", j], "q_norm", "does not use")
    r = run(["eval", "--model", base / "model_qnorm", "--data", base / "tokens.jsonl", "--seq-len", 8])
    assert r.returncode == 1 and "q_norm" in r.stderr, r
    # HF drops rotary_emb.inv_freq itself (older Llama exports hold it): still accepted
    w.pop("model.layers.0.self_attn.q_norm.weight")
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, dtype=np.float32)
    st.write(path, w, "F32")
    ok(["train", j, "--set", "train.overwrite_output_dir=true"])
