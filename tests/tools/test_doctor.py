"""qtune doctor: the environment report, a good and a bad job, and the known-failure table whose
messages are the program's own strings (each constant of src/core/messages.h is used in src/)."""
import json
import os
import re
import shutil
import struct
import subprocess

import pytest

from conftest import SRC, qtune, write_fake_model


def good_job(tmp_path):
    write_fake_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text('{"text": "hello world"}\n')
    job = {
        "model": "model", "output_dir": "runs/a",
        "data": {"train": "train.jsonl", "seq_len": 64},
        "lora": {"r": 8, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
        "train": {"max_steps": 2, "seed": 1},
        "deepspeed": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                      "fp16": {"enabled": True}, "zero_optimization": {"stage": 0}},
    }
    p = tmp_path / "job.json"
    p.write_text(json.dumps(job))
    return p, job


def test_environment_report():
    p = qtune("doctor", "--no-table", check=0)
    for key in ("AVX2", "AVX-512F", "AVX512_BF16", "F16C", "OpenBLAS", "openmp", "mpi", "cuda", "memory"):
        assert key in p.stdout, f"{key} missing from:\n{p.stdout}"


def _doctor_blas(**set_env):
    """qtune doctor's OpenBLAS lines with OPENBLAS_CORETYPE / QTUNE_BLAS_CORE_WAS as given (else unset)."""
    from conftest import QTUNE
    e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "QTUNE_BLAS_CORE_WAS")}
    e.update(set_env)
    p = subprocess.run([QTUNE, "doctor", "--no-table"], capture_output=True, text=True, env=e, timeout=120)
    lines = p.stdout.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith("blas"))
    return lines[i], (lines[i + 1] if i + 1 < len(lines) else "")


WEAK_BLAS_CORES = {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "sandybridge", "bulldozer",
                   "piledriver", "steamroller", "excavator", "barcelona", "opteron", "katmai", "coppermine",
                   "northwood", "banias"}


def test_openblas_runs_the_cpus_own_kernels():
    # Debian's OpenBLAS 0.3.21 does not know newer Xeons and falls back to its SSE3 "Prescott" kernels (a
    # quarter of the fp32 GEMM rate): qtune names the CPU's core in OPENBLAS_CORETYPE and says so in doctor.
    flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
    if not {"avx2", "fma"} <= set(flags):
        pytest.skip("this CPU has no AVX2 + FMA")
    blas, note = _doctor_blas()
    core = blas.split("DYNAMIC_ARCH")[-1].split()
    core = [w for w in core if w not in ("NO_AFFINITY", "NO_LAPACKE")][0] if "DYNAMIC_ARCH" in blas else "?"
    assert core.lower() not in WEAK_BLAS_CORES, blas
    if "qtune set OPENBLAS_CORETYPE" in note:
        assert "kernels on this CPU" in note and core in note, note


def test_openblas_coretype_of_the_user_is_kept():
    blas, note = _doctor_blas(OPENBLAS_CORETYPE="Haswell")
    assert " Haswell " in blas, blas
    assert "qtune set OPENBLAS_CORETYPE" not in note, note


def test_good_job_exits_zero(tmp_path):
    job, _ = good_job(tmp_path)
    p = qtune("doctor", job, "--ranks", "1", check=0)
    assert "no problems found" in p.stdout
    assert "plan " in p.stdout and "GiB per rank" in p.stdout


def test_bad_job_names_every_problem(tmp_path):
    job, j = good_job(tmp_path)
    j["model"] = "no-such-model"
    j["data"]["train"] = "missing.jsonl"
    j["deepspeed"]["train_batch_size"] = 6          # != 2 x 2 x 1
    j["deepspeed"]["bf16"] = {"enabled": True}      # with fp16 too
    j["deepspeed"]["zero_optimization"] = {"stage": 0, "offload_optimizer": {"device": "nvme"}}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "1", "--no-table")
    assert p.returncode != 0
    out = p.stdout
    assert "no-such-model" in out and "not a folder" in out
    assert "missing.jsonl" in out and "cannot be read" in out
    assert "train_batch_size 6" in out
    assert "fp16.enabled and bf16.enabled are both true" in out  # the DeepSpeed parser's sentences, each section's
    assert '"nvme"' in out
    n = len(re.findall(r"^  problem: ", out, re.M))
    assert n >= 5, out
    assert "problem" in p.stderr and str(job) in p.stderr


@pytest.mark.parametrize("extra,msg", [
    ({"modules_to_save": ["embed_tokens", "norm"]}, "modules_to_save names 'norm'"),
    ({"layers_to_transform": [0], "layers_pattern": "h"}, "layers_pattern 'h' does not match"),
    ({"layers_pattern": "layers"}, "layers_pattern is set but layers_to_transform is not"),
])
def test_lora_modules_to_save_and_layers(tmp_path, extra, msg):
    """PEFT's modules_to_save / layers_to_transform / layers_pattern checked against the model as the run
    checks them (a good one is no problem)."""
    job, j = good_job(tmp_path)
    j["lora"]["modules_to_save"] = ["embed_tokens", "lm_head"]
    j["lora"]["layers_to_transform"] = [1]
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "1", "--no-table", check=0)
    assert "no problems found" in p.stdout, p.stdout
    del j["lora"]["layers_to_transform"]
    j["lora"].update(extra)
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "1", "--no-table")
    assert p.returncode != 0 and msg in p.stdout, p.stdout


def test_unreadable_job(tmp_path):
    p = qtune("doctor", tmp_path / "nope.json", "--no-table")
    assert p.returncode != 0 and "nope.json" in p.stdout


def test_ranks_change_batch_identity(tmp_path):
    job, _ = good_job(tmp_path)
    p = qtune("doctor", job, "--ranks", "2", "--no-table")
    assert p.returncode != 0 and "x world size 2 (= 8)" in p.stdout, p.stdout


def test_deepspeed_problem_is_the_runs_sentence(tmp_path):
    """The doctor reads the DeepSpeed settings from the run's own setup (run_setup.h), not from arithmetic of its
    own over the JSON: a batch that does not add up for the ranks is named in the sentence `qtune train` stops
    with, and a job that loads gets the plan of its setup."""
    job, j = good_job(tmp_path)
    j["deepspeed"]["train_batch_size"] = 6  # != 2 x 2 x 1 rank; the job loads (that needs the world size)
    job.write_text(json.dumps(j))
    d = qtune("doctor", job, "--ranks", "1", "--no-table")
    t = qtune("train", job, check=None)
    assert t.returncode != 0
    said = [l for l in t.stderr.splitlines() if "train_batch_size 6 is not" in l]
    assert said, t.stderr
    sentence = said[0][said[0].index(str(job)):]
    assert "  problem: " + sentence in d.stdout, d.stdout + t.stderr
    assert len(re.findall(r"^  problem: ", d.stdout, re.M)) == 1, d.stdout


def _joined_literals(c_text):
    """The source with comments dropped and adjacent C string literals joined, so a message split
    over several lines reads as one string."""
    c_text = re.sub(r"/\*.*?\*/", " ", c_text, flags=re.S)
    return re.sub(r'"\s*(?:\\\s*\n\s*)?"', "", c_text)


MESSAGE_HEADERS = ["src/core/messages.h", "src/optim/loss_scaler.h"]


def _constants():
    """Every QT_MSG_* constant the doctor's table draws from, with its text."""
    out = {}
    for h in MESSAGE_HEADERS:
        text = open(os.path.join(SRC, h)).read()
        for m in re.finditer(r"#define\s+(QT_MSG_\w+)((?:[^\n]*\\\n)*[^\n]*)", text):
            out[m.group(1)] = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2)))
    return out


def test_table_shows_every_message():
    consts = _constants()
    assert len(consts) >= 5 and "QT_MSG_LOSS_SCALE_FLOOR_FMT" in consts
    doctor = open(os.path.join(SRC, "src/train/doctor.c")).read()
    table = qtune("doctor").stdout
    for name, text in consts.items():
        assert re.search(r"\b%s\b" % name, doctor), f"{name} is not in the doctor's table"
        # the fixed text before the first conversion (or after it) is shown verbatim
        pieces = [x for x in re.split(r"%[-+ #0-9.*lhzjt]*[a-zA-Z]", text) if len(x.strip()) > 10]
        for piece in pieces:
            assert piece.replace('\\"', '"').strip() in table, f"{name}: '{piece}' missing from the table"


def _sources():
    out = {}
    for root, _, files in os.walk(os.path.join(SRC, "src")):
        for fn in files:
            if fn.endswith(".c") and fn != "doctor.c":
                text = open(os.path.join(root, fn), errors="replace").read()
                out[os.path.join(root, fn)] = (text, _joined_literals(text))
    return out


# Constants whose owner has not wired them in yet. strict: once the code prints one, this test
# XPASSes and fails, so the entry must then be removed here.
PENDING = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=PENDING[n]))
                                  if n in PENDING else n for n in sorted(_constants())])
def test_each_message_is_printed_by_the_code(name):
    """The constant is used by name in src/ (outside the doctor), or its exact text is there."""
    text = _constants()[name]
    srcs = _sources().values()
    by_name = any(re.search(r"\b%s\b" % name, raw) for raw, _ in srcs)
    by_text = any(text in joined for _, joined in srcs)
    assert by_name or by_text, f"{name} is listed by the doctor but no code in src/ prints it"


def test_tokenizer_needed_only_for_text_data(tmp_path):
    job, j = good_job(tmp_path)
    os.remove(tmp_path / "model" / "tokenizer.json")
    p = qtune("doctor", job, "--no-table")  # text data: the tokenizer is missing
    assert p.returncode == 1 and "tokenizer.json" in p.stdout
    (tmp_path / "train.jsonl").write_text('{"input_ids": [1, 2, 3, 4]}\n')
    qtune("doctor", job, "--no-table", check=0)  # pre-tokenized: no tokenizer needed


def test_trainers_deepspeed_parser_is_consulted(tmp_path):
    job, j = good_job(tmp_path)
    j["deepspeed"]["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--no-table")
    assert p.returncode == 1 and "Lamb" in p.stdout


def test_reduce_bucket_auto_resolves_from_the_model(tmp_path):
    """reduce_bucket_size "auto" is resolved as the run resolves it: the model's hidden_size squared (64 x 64
    here), or DeepSpeed's 5e8 when the model's config.json cannot be read, said either way."""
    job, j = good_job(tmp_path)
    del j["deepspeed"]["train_batch_size"]  # 2 x 2 x 2 ranks
    j["deepspeed"]["zero_optimization"] = {"stage": 2, "reduce_bucket_size": "auto"}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--no-table", "--ranks", "2", check=0)
    assert "no problems found" in p.stdout, p.stdout
    assert ('zero_optimization.reduce_bucket_size "auto" -> 4096 (hidden_size 64 squared, as Hugging Face\'s '
            'Trainer fills it)') in p.stderr, p.stderr
    j["model"] = "no-such-model"
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--no-table", "--ranks", "2", check=1)
    assert 'zero_optimization.reduce_bucket_size "auto" -> 5e8 elements' in p.stderr, p.stderr
    assert "config.json could not be read" in p.stderr, p.stderr


@pytest.mark.parametrize("text", [
    '{"model": 3, "output_dir": [], "data": [], "deepspeed": 5, "lora": {"r": "x", "target_modules": 7}}',
    '{"model": "m", "data": {"train": "", "seq_len": 1e300}, "deepspeed": {"train_batch_size": 1e300, '
    '"train_micro_batch_size_per_gpu": 0.5, "gradient_accumulation_steps": -3, '
    '"zero_optimization": {"stage": "2", "offload_optimizer": {"device": 5}}}}',
    "[]", "", "{\"model\": ", '{"deepspeed": "/dev/null"}',
])
def test_malformed_jobs_are_problems_not_crashes(tmp_path, text):
    job = tmp_path / "job.json"
    job.write_text(text)
    p = qtune("doctor", job, "--no-table", "--ranks", "3")
    assert p.returncode == 1, p.stderr
    assert "problem:" in p.stdout


def test_set_overrides_reach_the_check(tmp_path):
    """qtune doctor JOB.json --set ... checks the job as `train --set` would run it."""
    job, _ = good_job(tmp_path)
    p = qtune("doctor", job, "--no-table", "--set", "deepspeed.train_batch_size=6")
    assert p.returncode == 1 and "train_batch_size 6" in p.stdout, p.stdout
    p = qtune("doctor", job, "--no-table", "--set", "data.train=nope.jsonl")
    assert p.returncode == 1 and "nope.jsonl" in p.stdout, p.stdout
    qtune("doctor", job, "--no-table", "--set", "train.max_steps=5", check=0)  # still good
    p = qtune("doctor", "--set", "train.max_steps=5", "--no-table")
    assert p.returncode == 2 and "needs a job file" in p.stderr


def test_every_data_line_is_read(tmp_path):
    """The first line train would stop on is named FILE:LINE; the lines before it are fine."""
    job, _ = good_job(tmp_path)
    lines = ['{"text": "line %d"}' % i for i in range(1, 40)]
    lines[29] = '{"text": "thirty", "oops": }'
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    p = qtune("doctor", job, "--no-table")
    assert p.returncode == 1
    assert "data.train: %s:30: not valid JSON" % (tmp_path / "train.jsonl") in p.stdout, p.stdout
    assert ":31:" not in p.stdout  # stops at the first bad line
    lines[29] = '{"messages": [{"role": "user", "content": "x"}]}'  # another format than line 1's
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    p = qtune("doctor", job, "--no-table")
    assert p.returncode == 1 and "train.jsonl:30:" in p.stdout, p.stdout
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:29]) + "\n")
    p = qtune("doctor", job, "--no-table", check=0)
    assert "29 examples read as text" in p.stdout and "no problems found" in p.stdout


def test_every_shard_is_opened(tmp_path):
    """A sharded model whose index names a missing or broken shard is a problem before train."""
    job, _ = good_job(tmp_path)
    m = tmp_path / "model"
    os.rename(m / "model.safetensors", m / "model-00001-of-00002.safetensors")
    hdr = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (m / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", len(hdr) + 50) + hdr)  # header overruns
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    p = qtune("doctor", job, "--no-table")
    assert p.returncode == 1 and "model-00002-of-00002.safetensors" in p.stdout, p.stdout
    (m / "model-00002-of-00002.safetensors").unlink()
    p = qtune("doctor", job, "--no-table")
    assert p.returncode == 1 and "model-00002-of-00002.safetensors" in p.stdout, p.stdout


def test_output_folder_must_take_a_file(tmp_path):
    if os.geteuid() == 0 and not shutil.which("chattr"):
        pytest.skip("root writes anywhere and chattr is missing")
    job, j = good_job(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    j["output_dir"] = "ro/run"
    job.write_text(json.dumps(j))
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported here")
    else:
        ro.chmod(0o555)
    try:
        p = qtune("doctor", job, "--no-table")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)])
        ro.chmod(0o755)
    assert p.returncode == 1 and "cannot be created or written" in p.stdout, p.stdout


def test_zero3_job(tmp_path):
    """Stage 3 is a stage qtune runs (full fine-tuning and LoRA, offload_param cpu read); an NVMe parameter
    offload is a problem, and so is QLoRA at stage 3, which names stage 2."""
    job, j = good_job(tmp_path)
    del j["lora"]
    j["deepspeed"]["train_batch_size"] = 8  # 2 x 2 x 2 ranks
    j["deepspeed"]["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "2", "--no-table")
    assert "no problems found" in p.stdout, p.stdout
    j["lora"] = {"r": 8}
    j["deepspeed"]["zero_optimization"] = {"stage": 3, "offload_param": {"device": "nvme"}}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "2", "--no-table")
    assert p.returncode != 0
    assert "does not partition" not in p.stdout, p.stdout  # LoRA at stage 3 runs (the base is partitioned)
    assert 'offload_param.device "nvme" is not supported' in p.stdout, p.stdout
    j["deepspeed"]["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "2", "--no-table")
    assert "no problems found" in p.stdout, p.stdout
    # QLoRA at stage 3 is refused, with what to use instead
    j["quantization"] = {"load_in_4bit": True}
    j["deepspeed"]["zero_optimization"] = {"stage": 3}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "2", "--no-table")
    assert p.returncode != 0
    assert "ZeRO stage 3 does not partition a 4-bit (QLoRA) base; use zero_optimization.stage 2" in p.stdout, p.stdout


def test_quantization_is_reported_from_the_runs_setup(tmp_path):
    """The job's "quantization" (QLoRA) as the run reads it (train/run_setup.c): a line saying what is 4-bit
    and the compute dtype, and a 4-bit compute dtype other than the run's precision is a problem, as `qtune
    train` refuses it when it loads the model (the doctor said nothing of the key, issue 40)."""
    job, j = good_job(tmp_path)  # fp16
    j["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                         "bnb_4bit_compute_dtype": "float16", "llm_int8_skip_modules": ["v_proj"]}
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "1", "--no-table", check=0)
    line = [l for l in p.stdout.splitlines() if l.startswith("quant ")]
    assert line and "4 bits" in line[0] and "nf4, double-quantized, 16-bit: v_proj" in line[0], p.stdout
    assert "compute f16" in line[0], p.stdout
    assert "bnb_4bit_compute_dtype" not in p.stdout, p.stdout
    j["quantization"]["bnb_4bit_compute_dtype"] = "bfloat16"
    job.write_text(json.dumps(j))
    p = qtune("doctor", job, "--ranks", "1", "--no-table")
    assert p.returncode != 0
    assert "quantization.bnb_4bit_compute_dtype is bf16 but the run computes in f16" in p.stdout, p.stdout
