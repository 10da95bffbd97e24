"""Nothing lost, round 3 (issue 42, items 1-4 and 8; docs/robustness.md):

- a file listed in a checkpoint's checksums.sha256 that is a FIFO or a link to
  /dev/zero is refused at once (resume used to block in open() or hash
  forever), and SIGTERM ends a long verification;
- a checksums.sha256 that is empty or leaves a file out names the unchecked
  files in a warning (a flipped bit used to resume in silence); CRLF line
  ends read as such;
- merge and export refuse NaN or inf weights of the base or the adapter,
  naming the tensor, and write nothing;
- temporaries a kill -9 left (OUT.gguf.tmp.PID, OUT.tmp.PID/,
  OUT/.qtune-merge.tmp.PID/) are removed by the next export or merge when
  their process is gone, and kept while it runs;
- NaN or Infinity in config.json is named by key and line."""
import hashlib
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from hostile_util import QTUNE, SRC, env, expect_error, ok, run, write, write_job, write_tokens

import st  # tests/ref, put on the path by hostile_util

LORA = {"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model and a LoRA run of 2 steps with checkpoint-2 and final/."""
    d = tmp_path_factory.mktemp("lost")
    # a tokenizer, which export writes into the GGUF
    tok = os.path.join(SRC, "fuzz", "corpus", "tokenizer", "tiny.json")
    ok(["init", "--out", d / "model", "--preset", "tiny", "--seed", "1", "--tokenizer", tok])
    write_tokens(d / "tokens.jsonl", n=16)
    j = write_job(d / "job.json", "model", "run", "tokens.jsonl", lora=LORA,
                  train_opts={"max_steps": 2, "save_steps": 2}, ds=DS)
    ok(["train", j])
    return d


def resumable(base, tmp_path):
    """A copy of the run whose job trains on to step 3 from checkpoint-2."""
    shutil.copytree(base / "model", tmp_path / "model")
    shutil.copy(base / "tokens.jsonl", tmp_path / "tokens.jsonl")
    shutil.copytree(base / "run", tmp_path / "run")
    j = write_job(tmp_path / "job.json", "model", "run", "tokens.jsonl", lora=LORA,
                  train_opts={"max_steps": 3, "save_steps": 2}, ds=DS)
    return j, tmp_path / "run" / "checkpoint-2"


def sum_line(path, name):
    return "%s  %s\n" % (hashlib.sha256(open(path, "rb").read()).hexdigest(), name)


def flip_a_bit(path):
    b = bytearray(open(path, "rb").read())
    b[-3] ^= 0x01
    write(path, bytes(b))


# ---------------------------------------------------------------------------
# item 1: special files in the list

@pytest.mark.parametrize("kind", ["dev_zero", "fifo"])
def test_a_listed_special_file_is_refused_at_once(base, tmp_path, kind):
    j, ck = resumable(base, tmp_path)
    cfg = ck / "config.json"
    if kind == "fifo":
        os.mkfifo(cfg)
    else:
        os.symlink("/dev/zero", cfg)
    with open(ck / "checksums.sha256", "a") as f:
        f.write("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  config.json\n")
    t0 = time.time()
    expect_error(["train", j], str(cfg), "FIFO" if kind == "fifo" else "character device", "not a regular file",
                 "damaged", timeout=30)
    assert time.time() - t0 < 30


def test_sigterm_ends_a_long_verification(base, tmp_path):
    """A listed 64 GiB file (sparse: no disk) takes minutes to hash; SIGTERM
    ends the run within seconds with exit 130 (the handler restarted the
    read, and the hashing went on to the end)."""
    j, ck = resumable(base, tmp_path)
    with open(ck / "big.bin", "wb") as f:
        f.truncate(64 << 30)
    with open(ck / "checksums.sha256", "a") as f:
        f.write("0" * 64 + "  big.bin\n")
    p = subprocess.Popen([QTUNE, "train", j], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    time.sleep(2.0)
    assert p.poll() is None, p.communicate()
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    try:
        _, se = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 130, se
    assert time.time() - t0 < 10, se
    assert "big.bin" in se, se


# ---------------------------------------------------------------------------
# item 2: a list that leaves files out; CRLF

def test_an_empty_list_warns_naming_the_unchecked_files(base, tmp_path):
    j, ck = resumable(base, tmp_path)
    write(ck / "checksums.sha256", "")
    flip_a_bit(ck / "adapter_model.safetensors")
    r = run(["train", j])
    warn = [l for l in r.stderr.splitlines() if "checksums.sha256 does not list" in l]
    assert warn and "adapter_model.safetensors" in warn[0] and "trainer_state.json" in warn[0], r
    assert "without being checked" in warn[0], r


def test_a_list_leaving_out_the_weights_warns(base, tmp_path):
    j, ck = resumable(base, tmp_path)
    lines = open(ck / "checksums.sha256").read().splitlines(True)
    write(ck / "checksums.sha256", "".join(l for l in lines if "adapter_model" not in l))
    flip_a_bit(ck / "adapter_model.safetensors")
    r = run(["train", j])
    warn = [l for l in r.stderr.splitlines() if "checksums.sha256 does not list" in l]
    assert warn and "adapter_model.safetensors" in warn[0], r
    assert "trainer_state.json" not in warn[0], r


def test_a_crlf_list_reads_and_still_checks(base, tmp_path):
    j, ck = resumable(base, tmp_path)
    text = open(ck / "checksums.sha256").read()
    write(ck / "checksums.sha256", text.replace("\n", "\r\n"))
    r = ok(["train", j])
    assert "does not list" not in r.stderr and "is missing" not in r.stderr, r
    # the same list with a flipped bit: still caught
    j2, ck2 = resumable(base, tmp_path / "again")
    write(ck2 / "checksums.sha256", text.replace("\n", "\r\n"))
    flip_a_bit(ck2 / "adapter_model.safetensors")
    expect_error(["train", j2], "adapter_model.safetensors does not match its SHA-256")


# ---------------------------------------------------------------------------
# item 3: NaN in what merge and export write

def poisoned_adapter(base, tmp_path):
    ad = tmp_path / "adapter"
    shutil.copytree(base / "run" / "final", ad)
    w = st.read(ad / "adapter_model.safetensors")
    name = sorted(k for k in w if "lora_B" in k)[0]
    w[name] = w[name].copy()
    w[name].flat[1] = np.nan
    st.write(ad / "adapter_model.safetensors", w)
    return ad, name


def poisoned_model(base, tmp_path):
    m = tmp_path / "model_nan"
    shutil.copytree(base / "model", m)
    path = m / "model.safetensors"
    dtypes = st.read_dtypes(path)
    w = st.read(path)
    name = "model.layers.0.mlp.down_proj.weight"
    w[name] = w[name].copy()
    w[name].flat[5] = np.inf
    st.write(path, w, dtype=dtypes[name])
    return m, name


def test_merge_refuses_a_nan_adapter(base, tmp_path):
    ad, name = poisoned_adapter(base, tmp_path)
    expect_error(["merge", "--model", base / "model", "--adapter", ad, "--out", tmp_path / "merged"], name, "NaN")
    assert not os.path.exists(tmp_path / "merged")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("merged")]


def test_merge_refuses_an_inf_base(base, tmp_path):
    m, name = poisoned_model(base, tmp_path)
    os.makedirs(tmp_path / "merged")
    write(tmp_path / "merged" / "keep.txt", "mine")
    expect_error(["merge", "--model", m, "--adapter", base / "run" / "final", "--out", tmp_path / "merged"], name,
                 "infinite", "left as it was")
    assert sorted(os.listdir(tmp_path / "merged")) == ["keep.txt"]


def test_export_refuses_nan_and_inf(base, tmp_path):
    ad, name = poisoned_adapter(base, tmp_path)
    out = tmp_path / "m.gguf"
    expect_error(["export", "--model", base / "model", "--adapter", ad, "--gguf", out], name, "NaN", "damaged")
    expect_error(["export", "--model", base / "model", "--adapter", ad, "--gguf-lora", out], name, "NaN")
    m, _ = poisoned_model(base, tmp_path)
    expect_error(["export", "--model", m, "--gguf", out], "blk.0.ffn_down.weight", "infinite", "not written")
    expect_error(["export", "--model", m, "--adapter", base / "run" / "final", "--gguf", out],
                 "blk.0.ffn_down.weight", "infinite", "merged with")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("m.gguf")]


@pytest.mark.parametrize("kind", ["dev_zero", "fifo"])
def test_merge_refuses_a_special_side_file(base, tmp_path, kind):
    """Found beside item 1: merge copied the model folder's side files with a
    plain fopen, so a FIFO tokenizer_config.json blocked it for ever (SIGTERM
    too) and a link to /dev/zero filled the disk."""
    m = tmp_path / "model"
    shutil.copytree(base / "model", m)
    os.unlink(m / "tokenizer_config.json")
    if kind == "fifo":
        os.mkfifo(m / "tokenizer_config.json")
    else:
        os.symlink("/dev/zero", m / "tokenizer_config.json")
    expect_error(["merge", "--model", m, "--adapter", base / "run" / "final", "--out", tmp_path / "merged"],
                 "tokenizer_config.json", "not a regular file", timeout=10)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("merged")]


def test_a_fifo_model_file_or_doctor_data_does_not_hang(base, tmp_path):
    """Found beside item 1: a FIFO named model.safetensors blocked eval (and
    every command that loads the model) in open(), and `qtune doctor` blocked
    on a FIFO named as the data, each for ever."""
    m = tmp_path / "model"
    shutil.copytree(base / "model", m)
    os.unlink(m / "model.safetensors")
    os.mkfifo(m / "model.safetensors")
    expect_error(["eval", "--model", m, "--data", base / "tokens.jsonl", "--seq-len", "8"], "model.safetensors",
                 "FIFO", timeout=10)
    os.mkfifo(tmp_path / "data.jsonl")
    j = write_job(tmp_path / "job.json", str(base / "model"), "out", "data.jsonl", lora=LORA, ds=DS)
    r = run(["doctor", j], timeout=10)
    assert r.returncode == 1 and "data.jsonl, which is a FIFO (named pipe), not a regular file" in r.stdout + r.stderr, r


# ---------------------------------------------------------------------------
# item 4: temporaries of killed exports and merges

def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_export_removes_a_dead_exports_temporary(base, tmp_path):
    out = tmp_path / "m.gguf"
    dead, live = tmp_path / ("m.gguf.tmp.%d" % dead_pid()), tmp_path / ("m.gguf.tmp.%d" % os.getpid())
    write(dead, b"half a file")
    write(live, b"another export, still running")
    ok(["export", "--model", base / "model", "--gguf", out, "--dtype", "f32"])
    assert not dead.exists()
    assert live.exists() and out.exists()


def test_merge_removes_a_dead_merges_staging_folders(base, tmp_path):
    new = tmp_path / "new"
    beside = tmp_path / ("new.tmp.%d" % dead_pid())
    os.makedirs(beside)
    write(beside / "model.safetensors", b"partial")
    ok(["merge", "--model", base / "model", "--adapter", base / "run" / "final", "--out", new])
    assert not beside.exists()
    inside = new / (".qtune-merge.tmp.%d" % dead_pid())
    alive = new / (".qtune-merge.tmp.%d" % os.getpid())
    os.makedirs(inside)
    os.makedirs(alive)
    ok(["merge", "--model", base / "model", "--adapter", base / "run" / "final", "--out", new])
    assert not inside.exists()
    assert alive.exists()


def test_a_real_kill_9_of_export_is_cleaned_up(base, tmp_path):
    """kill -9 while the GGUF is written (slowed by a stop-free pipe: the
    file is written as soon as export starts, so the kill lands after its
    temporary appears), then the next export removes it."""
    out = tmp_path / "k.gguf"
    for _ in range(50):
        p = subprocess.Popen([QTUNE, "export", "--model", base / "model", "--gguf", out, "--dtype", "f32"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
        tmp = tmp_path / ("k.gguf.tmp.%d" % p.pid)
        t0 = time.time()
        while not tmp.exists() and p.poll() is None and time.time() - t0 < 10:
            time.sleep(0.0005)
        p.kill()
        p.wait()
        if tmp.exists():
            break
        if out.exists():
            os.unlink(out)
    else:
        pytest.skip("the export finished before a kill could land")
    ok(["export", "--model", base / "model", "--gguf", out, "--dtype", "f32"])
    assert not tmp.exists()
    assert [n for n in os.listdir(tmp_path)] == ["k.gguf"]


# ---------------------------------------------------------------------------
# item 8: NaN in config.json

@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
def test_config_nan_names_key_and_line(base, tmp_path, word):
    m = tmp_path / "model"
    shutil.copytree(base / "model", m)
    text = open(m / "config.json").read()
    lines = text.splitlines(True)
    at = next(i for i, l in enumerate(lines) if '"rms_norm_eps"' in l)
    lines[at] = lines[at].split(":")[0] + ": " + word + ("," if lines[at].rstrip().endswith(",") else "") + "\n"
    write(m / "config.json", "".join(lines))
    expect_error(["eval", "--model", m, "--data", base / "tokens.jsonl", "--seq-len", "8"],
                 "config.json: line %d" % (at + 1), "rms_norm_eps is %s" % word)


def nan_at(path, obj, marker, word):
    """obj written as indented JSON with the number marker replaced by word;
    returns the 1-based line of it."""
    import json
    text = json.dumps(obj, indent=1)
    assert text.count(repr(marker)) == 1
    write(path, text.replace(repr(marker), word))
    return text[:text.index(repr(marker))].count("\n") + 1


def test_nan_in_a_job_deepspeed_or_adapter_config_is_named(base, tmp_path):
    """The same for the other JSON a user writes or a script saves: the job
    file, a DeepSpeed file, adapter_config.json."""
    ds = dict(DS, optimizer={"type": "AdamW", "params": {"lr": 12345.5}})
    job = {"model": str(base / "model"), "output_dir": "out", "data": {"train": str(base / "tokens.jsonl"),
                                                                        "seq_len": 8}, "deepspeed": ds}
    line = nan_at(tmp_path / "job.json", job, 12345.5, "NaN")
    expect_error(["train", tmp_path / "job.json"], "job.json: line %d" % line, "deepspeed.optimizer.params.lr is NaN")
    line = nan_at(tmp_path / "ds.json", ds, 12345.5, "Infinity")
    write(tmp_path / "job2.json", '{"model": "%s", "output_dir": "out", "data": {"train": "%s", "seq_len": 8}, '
          '"deepspeed": "ds.json"}' % (base / "model", base / "tokens.jsonl"))
    expect_error(["train", tmp_path / "job2.json"], "ds.json: line %d" % line, "optimizer.params.lr is Infinity")
    ad = tmp_path / "adapter"
    shutil.copytree(base / "run" / "final", ad)
    import json
    cfg = json.load(open(ad / "adapter_config.json"))
    cfg["lora_alpha"] = 12345.5
    line = nan_at(ad / "adapter_config.json", cfg, 12345.5, "NaN")
    expect_error(["merge", "--model", base / "model", "--adapter", ad, "--out", tmp_path / "m"],
                 "adapter_config.json: line %d" % line, "lora_alpha is NaN")
