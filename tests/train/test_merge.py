"""qtune merge: W' = W + (B @ A) * scaling in fp32 then cast, as peft's
merge_and_unload; the merged model evaluates like base + adapter."""
import json
import os
import shutil

import numpy as np
import pytest

from trainutil import QTUNE, init_model, run, st, write_job, write_tokens


def eval_loss(*args):
    p = run("eval", *args)
    return json.loads(p.stdout.strip().splitlines()[-1])


QWEN2_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("preset,rslora", [("tiny", False), ("tiny", True), ("tiny-qwen3", False)])
def test_merge_matches_adapter(tmp_path, preset, rslora):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), preset)
    write_tokens(os.path.join(d, "train.jsonl"), 16, 16, seed=1)
    write_tokens(os.path.join(d, "eval.jsonl"), 8, 16, seed=2)
    targets = QWEN2_TARGETS
    lora = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.0, "use_rslora": rslora, "target_modules": targets}
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}}
    job = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", lora=lora, ds=ds,
                    train_opts={"max_steps": 4})
    run("train", job)
    adapter = os.path.join(d, "out", "final")
    merged = os.path.join(d, "merged")
    run("merge", "--model", model, "--adapter", adapter, "--out", merged)

    # weights: numpy's W + B @ A * scaling
    base = st.read(os.path.join(model, "model.safetensors"))
    ad = st.read(os.path.join(adapter, "adapter_model.safetensors"))
    out = st.read(os.path.join(merged, "model.safetensors"))
    assert set(out) == set(base)
    scaling = 16 / (np.sqrt(4) if rslora else 4)
    n_merged = 0
    for k, w in base.items():
        key = "base_model.model." + k[:-len(".weight")]
        if key + ".lora_A.weight" in ad:
            a, b = ad[key + ".lora_A.weight"].astype(np.float64), ad[key + ".lora_B.weight"].astype(np.float64)
            want = w + (b @ a) * scaling
            assert np.allclose(out[k], want, rtol=1e-5, atol=1e-6), k
            assert not np.allclose(out[k], w), k
            n_merged += 1
        else:
            assert np.array_equal(out[k], w), k
    assert n_merged == 2 * 7  # 2 layers x 7 modules
    assert os.path.exists(os.path.join(merged, "config.json"))

    # the merged model evaluates like base + adapter
    data = os.path.join(d, "eval.jsonl")
    with_adapter = eval_loss("--model", model, "--adapter", adapter, "--data", data, "--seq-len", 16)
    folded = eval_loss("--model", merged, "--data", data, "--seq-len", 16)
    plain = eval_loss("--model", model, "--data", data, "--seq-len", 16)
    assert with_adapter["tokens"] == folded["tokens"] > 0
    assert abs(with_adapter["loss"] - folded["loss"]) <= 1e-5 * with_adapter["loss"]
    assert abs(with_adapter["loss"] - plain["loss"]) > 1e-4  # the adapter changes something

    # --dtype casts every tensor and says so in config.json
    merged16 = os.path.join(d, "merged_bf16")
    run("merge", "--model", model, "--adapter", adapter, "--out", merged16, "--dtype", "bf16")
    assert set(st.read_dtypes(os.path.join(merged16, "model.safetensors")).values()) == {"BF16"}
    assert json.load(open(os.path.join(merged16, "config.json")))["torch_dtype"] == "bfloat16"


def test_merge_errors(tmp_path):
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    p = run("merge", "--model", model, "--adapter", os.path.join(d, "nope"), "--out", os.path.join(d, "m"),
            check=False)
    assert p.returncode == 1 and "adapter_config.json" in p.stderr
    p = run("merge", "--model", model, check=False)
    assert p.returncode == 2
    # an adapter for another shape is refused by name
    ad = os.path.join(d, "ad")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"),
             {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 99), np.float32),
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)})
    json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    p = run("merge", "--model", model, "--adapter", ad, "--out", os.path.join(d, "m2"), check=False)
    assert p.returncode == 1 and "q_proj" in p.stderr
    assert not os.path.exists(os.path.join(d, "m2", "model.safetensors"))


def tiny_adapter(d, tensors, target_modules, name="ad", alpha=8):
    """An adapter folder holding the given {module: (A, B)} for the tiny model (hidden 64, r 4)."""
    ad = os.path.join(d, name)
    os.makedirs(ad, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for module, (n_out, n_in) in tensors.items():
        arrays["base_model.model.%s.lora_A.weight" % module] = rng.standard_normal((4, n_in)).astype(np.float32)
        arrays["base_model.model.%s.lora_B.weight" % module] = rng.standard_normal((n_out, 4)).astype(np.float32)
    st.write(os.path.join(ad, "adapter_model.safetensors"), arrays)
    json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": alpha, "target_modules": target_modules},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    return ad


Q0 = "model.layers.0.self_attn.q_proj"
V1 = "model.layers.1.self_attn.v_proj"


def test_merge_refuses_tensors_outside_target_modules(tmp_path):
    """A LoRA weight for a module target_modules does not name is refused by
    name (PEFT would never load it), not merged or dropped; nothing is written."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    ad = tiny_adapter(d, {Q0: (64, 64), V1: (32, 64)}, ["q_proj"])
    out = os.path.join(d, "m")
    p = run("merge", "--model", model, "--adapter", ad, "--out", out, check=False)
    assert p.returncode == 1, p.stderr
    assert V1 + ".lora_A.weight" in p.stderr and "target_modules" in p.stderr and "q_proj" in p.stderr, p.stderr
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(d) if ".tmp." in f]
    # the same tensors with both modules named merge, and so does a suffix
    # match on the full module path, as PEFT matches target_modules
    for targets in (["q_proj", "v_proj"], [Q0, "v_proj"], "all-linear"):
        ad2 = tiny_adapter(d, {Q0: (64, 64), V1: (32, 64)}, targets, name="ad2")
        run("merge", "--model", model, "--adapter", ad2, "--out", out)
        shutil.rmtree(out)
    ad3 = tiny_adapter(d, {Q0: (64, 64)}, ["self_attn.q"], name="ad3")  # a partial name is no match
    p = run("merge", "--model", model, "--adapter", ad3, "--out", out, check=False)
    assert p.returncode == 1 and "target_modules (self_attn.q)" in p.stderr, p.stderr


def test_merge_names_targeted_modules_without_lora(tmp_path):
    """An adapter with no LoRA for some modules its target_modules select (a file cut short, a
    hand-made adapter) merged what it held in silence. PEFT loads such an adapter with a warning and
    leaves those modules at B = 0, which the merge matches; now it says how many and names the first.
    The same warning comes from export --gguf, which merges through the same code."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    out = os.path.join(d, "m")
    ad = tiny_adapter(d, {Q0: (64, 64)}, ["q_proj", "v_proj"])
    p = run("merge", "--model", model, "--adapter", ad, "--out", out)
    assert "selects 3 modules of the model that the adapter holds no LoRA weights for (the first: " \
           "model.layers.0.self_attn.v_proj)" in p.stderr, p.stderr
    assert np.array_equal(st.read(os.path.join(out, "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"],
                          st.read(os.path.join(model, "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"])
    # every selected module held (both layers' q): no warning, all-linear's embedding is not counted
    full = tiny_adapter(d, {Q0: (64, 64), "model.layers.1.self_attn.q_proj": (64, 64)}, ["q_proj"], name="full")
    shutil.rmtree(out)
    p = run("merge", "--model", model, "--adapter", full, "--out", out)
    assert "holds no LoRA" not in p.stderr, p.stderr
    p = run("export", "--model", model, "--adapter", ad, "--gguf", os.path.join(d, "x.gguf"), check=False)
    assert "holds no LoRA weights for" in p.stderr, p.stderr


def test_merge_checks_the_model_folder_first(tmp_path):
    """A wrong --model gets the model-folder sentence even when the adapter is
    wrong too (it was reported as a missing adapter_config.json)."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    out = os.path.join(d, "m")
    nope = os.path.join(d, "nope")
    p = run("merge", "--model", os.path.join(d, "no-model"), "--adapter", nope, "--out", out, check=False)
    assert p.returncode == 1 and "--model" in p.stderr and "no-model" in p.stderr and "does not exist" in p.stderr, \
        p.stderr
    assert "adapter_config" not in p.stderr
    os.makedirs(os.path.join(d, "empty"))
    p = run("merge", "--model", os.path.join(d, "empty"), "--adapter", nope, "--out", out, check=False)
    assert p.returncode == 1 and "empty has no config.json" in p.stderr, p.stderr
    os.makedirs(os.path.join(d, "cfg_only"))
    shutil.copy(os.path.join(model, "config.json"), os.path.join(d, "cfg_only"))
    p = run("merge", "--model", os.path.join(d, "cfg_only"), "--adapter", nope, "--out", out, check=False)
    assert p.returncode == 1 and "model.safetensors" in p.stderr and "adapter_config" not in p.stderr, p.stderr
    p = run("merge", "--model", os.path.join(model, "config.json"), "--adapter", nope, "--out", out, check=False)
    assert p.returncode == 1 and "is not a folder" in p.stderr, p.stderr
    assert not os.path.exists(out)


def test_merge_refuses_an_out_that_cannot_hold_the_model(tmp_path):
    """--out the adapter folder (or any folder holding an adapter) is refused:
    transformers and PEFT load a folder with adapter_config.json as that
    adapter, not as the merged model; it was merged into. A --out below a file
    is named as such (the error named the staging folder). Nothing changes."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    ad = tiny_adapter(d, {Q0: (64, 64)}, ["q_proj"])
    before = sorted(os.listdir(ad))
    for out in (ad, ad + "/"):
        p = run("merge", "--model", model, "--adapter", ad, "--out", out, check=False)
        assert p.returncode == 1 and "holds an adapter (adapter_config.json)" in p.stderr, p.stderr
        assert sorted(os.listdir(ad)) == before
    cfg = os.path.join(model, "config.json")
    p = run("merge", "--model", model, "--adapter", ad, "--out", os.path.join(cfg, "x", "merged"), check=False)
    assert p.returncode == 1 and "is inside %s, which is a file" % cfg in p.stderr and ".tmp." not in p.stderr, \
        p.stderr
    assert sorted(os.listdir(d)) == ["ad", "model"]


def test_merge_modules_to_save_on_a_tied_bf16_model(tmp_path):
    """A tied bf16 model: a saved lm_head (f32 in the adapter, as qtune and
    PEFT write it) becomes a bf16 lm_head.weight like every other tensor (it
    was written f32); a saved module other than the embedding and lm_head
    leaves the model tied (it was untied, with a copy of the embedding)."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"), dtype="bf16")
    rng = np.random.default_rng(1)
    ad = tiny_adapter(d, {Q0: (64, 64)}, ["q_proj"])
    saved = (rng.standard_normal((512, 64)) * 0.02).astype(np.float32)
    for name, key, value in (("lm_head", "base_model.model.lm_head.weight", saved),
                             ("norm", "base_model.model.model.norm.weight", np.full(64, 2, np.float32))):
        w = st.read(os.path.join(ad, "adapter_model.safetensors"))
        w = {k: v for k, v in w.items() if "lora_" in k}
        w[key] = value
        st.write(os.path.join(ad, "adapter_model.safetensors"), w)
        cfg = json.load(open(os.path.join(ad, "adapter_config.json")))
        json.dump(dict(cfg, modules_to_save=[name]), open(os.path.join(ad, "adapter_config.json"), "w"))
        out = os.path.join(d, "m_" + name)
        run("merge", "--model", model, "--adapter", ad, "--out", out)
        dtypes = st.read_dtypes(os.path.join(out, "model.safetensors"))
        assert set(dtypes.values()) == {"BF16"}, dtypes
        tied = json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"]
        merged = st.read(os.path.join(out, "model.safetensors"))
        if name == "lm_head":
            assert tied is False
            assert np.array_equal(merged["lm_head.weight"], st.bf16_to_f32(st.f32_to_bf16(saved)))
        else:
            assert tied is True and "lm_head.weight" not in dtypes
            assert np.array_equal(merged["model.norm.weight"], np.full(64, 2, np.float32))


@pytest.mark.parametrize("keys", [("torch_dtype",), ("dtype",), ("torch_dtype", "dtype")])
def test_merge_dtype_sets_every_dtype_key(tmp_path, keys):
    """--dtype rewrites each dtype key config.json has: torch_dtype (transformers
    <= 4.55) and dtype (later ones); the input model's value never survives."""
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["torch_dtype"]
    for k in keys:
        cfg[k] = "float32"
    json.dump(cfg, open(cfg_path, "w"))
    ad = tiny_adapter(d, {Q0: (64, 64)}, ["q_proj"])
    for dt, name in (("bf16", "bfloat16"), ("f16", "float16")):
        out = os.path.join(d, "m_" + dt)
        run("merge", "--model", model, "--adapter", ad, "--out", out, "--dtype", dt)
        got = json.load(open(os.path.join(out, "config.json")))
        assert {k: got[k] for k in keys} == {k: name for k in keys}, got
        assert "torch_dtype" in got or "dtype" in got
        assert set(st.read_dtypes(os.path.join(out, "model.safetensors")).values()) == {dt.upper()}


def big_model(d):
    """A model large enough (310 MB) that merging it takes a good fraction of a second."""
    cfg = json.load(open(os.path.join(init_model(os.path.join(d, "tiny")), "config.json")))
    cfg.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=32768)
    json.dump(cfg, open(os.path.join(d, "big.json"), "w"))
    run("init", "--out", os.path.join(d, "big"), "--config", os.path.join(d, "big.json"), "--seed", 1)
    return os.path.join(d, "big")


@pytest.mark.parametrize("previous", [True, False])
def test_merge_sigint_leaves_no_partial_output(tmp_path, previous):
    """Ctrl-C during the write: exit 130 with a sentence, the partial output is
    removed, and a previous merge in --out is byte for byte as it was (or no
    --out appears at all)."""
    import signal
    import subprocess
    import time
    d = str(tmp_path)
    model = big_model(d)
    ad = tiny_adapter(d, {Q0: (1024, 1024)}, ["q_proj"])
    out = os.path.join(d, "merged")
    before = {}
    if previous:
        os.makedirs(out)
        for name, data in (("model.safetensors", b"previous weights"), ("config.json", b"{}"), ("notes.txt", b"x")):
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)
        before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.Popen([QTUNE, "merge", "--model", model, "--adapter", ad, "--out", out, "--dtype", "bf16"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def writing():
        # the merge has started writing: a staging folder beside --out, or
        # (as qtune did before) a temporary file inside it
        staged = [f for f in os.listdir(d) if f.startswith("merged.tmp.")]
        inside = [f for f in os.listdir(out) if ".tmp." in f] if os.path.isdir(out) else []
        return staged or inside

    t0 = time.monotonic()
    while not writing() and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.001)
    assert p.poll() is None, "the merge finished before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)
    assert "interrupted" in err and out in err, err
    if previous:
        assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    else:
        assert not os.path.exists(out)
    assert sorted(os.listdir(d)) == sorted(["tiny", "big.json", "big", "ad"] + (["merged"] if previous else [])), \
        os.listdir(d)


def test_merge_failure_removes_the_folders_it_made(tmp_path):
    """--out a/b/merged where a/b did not exist: a merge that fails while it
    writes (here a file-size limit, as a full disk would) removed its staging
    folder but left the parent folders it had created behind. Now every folder
    merge made is removed; a folder of the user's on the way is kept."""
    import resource
    import signal
    import subprocess

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    d = str(tmp_path)
    model = init_model(os.path.join(d, "model"))
    ad = tiny_adapter(d, {Q0: (64, 64)}, ["q_proj"])
    mine = os.path.join(d, "mine")
    os.makedirs(mine)
    for out in (os.path.join(d, "made", "deeper", "merged"), os.path.join(mine, "made", "merged")):
        p = subprocess.run([QTUNE, "merge", "--model", model, "--adapter", ad, "--out", out], capture_output=True,
                           text=True, preexec_fn=small_files, timeout=120)
        assert p.returncode == 1 and "error" in p.stderr, p.stderr
        assert sorted(os.listdir(d)) == ["ad", "mine", "model"], os.listdir(d)
        assert os.listdir(mine) == [], os.listdir(mine)


def blocked_signals(pid):
    """The signal mask of pid's main thread (/proc/PID/status SigBlk)."""
    for line in open("/proc/%d/status" % pid):
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    return 0


@pytest.mark.parametrize("previous", [True, False])
def test_merge_second_ctrl_c_leaves_no_partial_output(tmp_path, previous):
    """A second Ctrl-C (which ends the process at once) left the staging
    folder OUT.tmp.PID (or OUT/.qtune-merge.tmp.PID) behind, and the parent
    folders merge had made for a new --out. Now the second Ctrl-C removes them
    before it exits: a previous --out is byte for byte as it was, or nothing
    new is left at all.

    Two signals sent at once merge into one, and after one the merge cleans up
    by itself, so the second is made to arrive while the first is handled:
    the merge's stderr is a pipe the test has filled, so the first handler
    blocks in its write (SIGINT masked); the second is sent then, and runs as
    soon as the pipe is drained and the first handler returns."""
    import signal
    import subprocess
    import threading
    import time
    d = str(tmp_path)
    model = big_model(d)
    ad = tiny_adapter(d, {Q0: (1024, 1024)}, ["q_proj"])
    if previous:
        out = os.path.join(d, "merged")
        os.makedirs(out)
        for name, data in (("model.safetensors", b"previous weights"), ("config.json", b"{}"), ("notes.txt", b"x")):
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)
        before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    else:
        out = os.path.join(d, "new", "deeper", "merged")
    listing = sorted(os.listdir(d))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r, w = os.pipe()
    p = subprocess.Popen([QTUNE, "merge", "--model", model, "--adapter", ad, "--out", out, "--dtype", "bf16"],
                         stdout=subprocess.DEVNULL, stderr=w, env=env)
    stage = os.path.join(out, ".qtune-merge.tmp.%d" % p.pid) if previous else "%s.tmp.%d" % (out, p.pid)
    t0 = time.monotonic()
    # the staging folder, not its model.safetensors: on a fast machine the 310 MB write can come and go between
    # two polls (the test failed 1 run in 2 on 180687f on an Intel Xeon); the handlers clean a folder the same way
    while not os.path.exists(stage) and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.0005)
    assert p.poll() is None, "the merge finished before it could be interrupted"
    # filled through a file description of its own: O_NONBLOCK on w would make the merge's writes fail, not wait
    fill = os.open("/proc/self/fd/%d" % w, os.O_WRONLY | os.O_NONBLOCK)
    try:
        while True:
            os.write(fill, b"." * 4096)
    except BlockingIOError:
        pass
    os.close(fill)
    sigint = 1 << (signal.SIGINT - 1)
    p.send_signal(signal.SIGINT)
    while not blocked_signals(p.pid) & sigint and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.001)
    assert p.poll() is None, "the merge ended before its first Ctrl-C handler ran"
    p.send_signal(signal.SIGINT)
    os.close(w)
    err = []
    drain = threading.Thread(target=lambda: err.append(b"".join(iter(lambda: os.read(r, 65536), b""))))
    drain.start()
    p.wait(timeout=120)
    drain.join(timeout=120)
    os.close(r)
    err = err[0].decode(errors="replace").lstrip(".")
    assert p.returncode == 130 and "second Ctrl-C" in err, (p.returncode, err)
    assert sorted(os.listdir(d)) == listing, os.listdir(d)
    if previous:
        assert sorted(os.listdir(out)) == sorted(before), os.listdir(out)
        assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
