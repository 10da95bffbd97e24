"""Device selection at the CLI (issue 20; src/backend/device.c): the job key
"device" (auto | cpu | cuda | cuda:N), --device on eval, generate and merge,
qtune plan --device, and QTUNE_BACKEND winning. GPUs are a stand-in module
(tests/unit/backend/fake_cuda_module.c, loaded through QTUNE_CUDA_MODULE) that
reports QTUNE_FAKE_GPUS GPUs and, asked to open one, fails with a sentence
naming it: so these tests run alike with or without a GPU or a CUDA build.
The cases about this machine's own answer (auto -> cpu, and why) are skipped
where an NVIDIA driver is present."""
import json
import os
import subprocess

import pytest

from trainutil import QTUNE, SRC, init_model, write_job, write_tokens

BUILD = os.environ.get("QTUNE_BUILD_DIR", os.path.join(SRC, "build"))
FAKE = os.path.join(BUILD, "tests", "fake_cuda", "libqtune_fake_cuda.so")
NO_DRIVER = not os.path.exists("/dev/nvidiactl")


def qtune(*args, gpus=None, **extra):
    """qtune with no QTUNE_BACKEND; gpus=N: the stand-in module with N GPUs."""
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for k in ("QTUNE_BACKEND", "QTUNE_LOG", "QTUNE_CUDA_DEVICE", "QTUNE_CUDA_MODULE", "QTUNE_FAKE_GPUS",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        e.pop(k, None)
    if gpus is not None:
        assert os.path.exists(FAKE), "build the tests first: %s is missing" % FAKE
        e.update(QTUNE_CUDA_MODULE=FAKE, QTUNE_FAKE_GPUS=str(gpus))
    e.update({k: str(v) for k, v in extra.items()})
    return subprocess.run([QTUNE] + [str(a) for a in args], capture_output=True, text=True, env=e, timeout=300)


def ok(p):
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def why_no_gpu_here():
    """the reason auto gives on this machine (no driver)"""
    built = os.path.exists(os.path.join(BUILD, "lib", "libqtune_cuda.so"))
    return ("no CUDA GPU is visible (no NVIDIA driver: /dev/nvidiactl is absent)" if built else
            "libqtune_cuda.so was not built (nvcc was not found when this qtune was configured)")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("device"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 8, 16, seed=1, min_len=4)
    return d


def job(base, name, device=None, **kw):
    path = write_job(os.path.join(base, name + ".json"), "model", "out_" + name, "train.jsonl",
                     train_opts={"max_steps": 1}, **kw)
    if device is not None:
        with open(path) as f:
            j = json.load(f)
        j["device"] = device
        with open(path, "w") as f:
            json.dump(j, f)
    return path, os.path.join(base, "out_" + name)


def run_line(p):
    lines = [l for l in p.stderr.splitlines() if l.startswith("qtune: run: ")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_job_device_values_are_checked(base):
    for value, says in [("gpu", '"device": "gpu" is not a device; use "auto"'),
                        ("cuda:x", '"device": "cuda:x" is not a device'),
                        ("", "device must be a non-empty string"),
                        (3, "device must be a non-empty string")]:
        j, out = job(base, "bad", value)
        p = qtune("train", j)
        assert p.returncode == 1 and "bad.json" in p.stderr and says in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not os.path.exists(out)


def test_cuda_without_a_gpu_is_one_sentence_and_writes_nothing(base):
    j, out = job(base, "nogpu", "cuda")
    p = qtune("train", j, gpus=0)
    assert p.returncode == 1, p.stderr
    assert ('nogpu.json: "device": "cuda" asks for a GPU, but no CUDA GPU is visible' in p.stderr and
            'use "cpu"' in p.stderr), p.stderr
    assert not os.path.exists(out)
    # --set device=... works as for any key
    j, out = job(base, "nogpu_set")
    p = qtune("train", j, "--set", "device=cuda:0", gpus=0)
    assert p.returncode == 1 and '"device": "cuda:0" asks for a GPU' in p.stderr, p.stderr
    assert not os.path.exists(out)


@pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is here: auto may find a GPU")
def test_this_machine_says_why_there_is_no_gpu(base):
    j, out = job(base, "auto_here")
    p = ok(qtune("train", j))
    assert "| device cpu (1 thread)" in run_line(p), p.stderr
    assert "qtune: device auto -> cpu: " + why_no_gpu_here() in p.stderr, p.stderr
    j, out = job(base, "cuda_here", "cuda")
    p = qtune("train", j)
    assert p.returncode == 1 and '"device": "cuda" asks for a GPU, but ' + why_no_gpu_here() in p.stderr, p.stderr
    assert not os.path.exists(out)


def test_a_module_the_user_names_loads_or_is_the_error(base, tmp_path):
    """issue 42 item 6: a wrong QTUNE_CUDA_MODULE was skipped in silence (auto
    went to the CPU, or the build tree's module loaded) and "cuda" blamed the
    driver; the path the user named is now the error, for every device that
    may use a GPU"""
    not_a_module = tmp_path / "libqtune_cuda.so"
    not_a_module.write_text("not an ELF file\n")
    for path, says in [(str(tmp_path / "typo" / "libqtune_cuda.so"), "No such file"),
                       (str(not_a_module), str(not_a_module))]:
        for device in (None, "cuda", "cuda:0"):
            j, out = job(base, "named_module", device)
            p = qtune("train", j, QTUNE_CUDA_MODULE=path)
            assert p.returncode == 1, p.stderr
            assert "QTUNE_CUDA_MODULE names a module that could not be loaded: " + path in p.stderr, p.stderr
            assert says in p.stderr and "unset QTUNE_CUDA_MODULE" in p.stderr, p.stderr
            assert "driver" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
            assert not os.path.exists(out)
    p = qtune("eval", "--model", os.path.join(base, "model"), "--data", os.path.join(base, "train.jsonl"),
              QTUNE_CUDA_MODULE=str(tmp_path / "typo.so"))
    assert p.returncode == 1 and "QTUNE_CUDA_MODULE names a module" in p.stderr, p.stderr
    # the CPU asked for by name does not load a module at all
    j, out = job(base, "named_module_cpu", "cpu")
    ok(qtune("train", j, QTUNE_CUDA_MODULE=str(tmp_path / "typo.so")))


def test_auto_and_named_gpus_reach_the_backend(base):
    j, out = job(base, "auto_gpu")
    p = qtune("train", j, gpus=2)
    assert p.returncode == 1, p.stderr
    assert "| device cuda:0 (Fake GPU 0)" in run_line(p)
    assert "qtune: device auto -> cuda:0: 2 GPUs visible" in p.stderr
    assert "asked to open GPU 0 of 2" in p.stderr
    j, out = job(base, "cuda1", "cuda:1")
    p = qtune("train", j, gpus=2)
    assert p.returncode == 1 and "| device cuda:1 (Fake GPU 1)" in run_line(p), p.stderr
    assert "asked to open GPU 1 of 2" in p.stderr
    assert not os.path.exists(out)
    j, out = job(base, "cuda5", "cuda:5")
    p = qtune("train", j, gpus=2)
    assert p.returncode == 1 and '"device": "cuda:5" names GPU 5, but 2 GPUs are visible' in p.stderr, p.stderr
    assert not os.path.exists(out)


def test_qtune_backend_still_wins(base):
    j, out = job(base, "guard", "cuda")
    p = ok(qtune("train", j, gpus=0, QTUNE_BACKEND="guard"))
    assert "| device guard (the CPU's kernels, 1 thread)" in run_line(p)
    assert 'qtune: QTUNE_BACKEND=guard overrides ' in p.stderr and 'guard.json: "device": "cuda"' in p.stderr
    assert os.path.exists(os.path.join(out, "final", "model.safetensors"))
    p = qtune("eval", "--model", os.path.join(base, "model"), "--data", os.path.join(base, "train.jsonl"),
              "--device", "cuda", gpus=0, QTUNE_BACKEND="guard")
    assert p.returncode == 0 and 'QTUNE_BACKEND=guard overrides --device "cuda"' in p.stderr, p.stderr


def test_device_is_not_what_is_trained(base):
    """a run may resume on another device: "device" is outside the fingerprint"""
    j, out = job(base, "resume", "cpu")
    ok(qtune("train", j))
    p = ok(qtune("train", j, "--set", "device=auto", "--set", "train.max_steps=2", gpus=0))
    assert "resuming from" in p.stderr, p.stderr


def test_eval_device(base):
    m, data = os.path.join(base, "model"), os.path.join(base, "train.jsonl")
    default = ok(qtune("eval", "--model", m, "--data", data, gpus=0)).stdout.splitlines()[-1]
    assert ok(qtune("eval", "--model", m, "--data", data, "--device", "cpu")).stdout.splitlines()[-1] == default
    p = qtune("eval", "--model", m, "--data", data, "--device", "gpu")
    assert p.returncode == 2 and "--device must be auto, cpu, cuda, cuda:N, npu or npu:N, not 'gpu'" in p.stderr, p.stderr
    p = qtune("eval", "--model", m, "--data", data, "--device", "cuda", gpus=0)
    assert p.returncode == 1 and '--device "cuda" asks for a GPU, but no CUDA GPU is visible' in p.stderr, p.stderr
    p = qtune("eval", "--model", m, "--data", data, "--device", "cuda:1", gpus=2)
    assert p.returncode == 1 and "qtune: device cuda:1 (Fake GPU 1)" in p.stderr, p.stderr
    assert "asked to open GPU 1 of 2" in p.stderr
    # under a launcher: "cuda" is the local rank's GPU; a named one is refused when ranks would share it
    p = qtune("eval", "--model", m, "--data", data, "--device", "cuda", gpus=2, OMPI_COMM_WORLD_LOCAL_RANK=3,
              OMPI_COMM_WORLD_LOCAL_SIZE=4)
    assert p.returncode == 1 and "asked to open GPU 1 of 2" in p.stderr, p.stderr
    p = qtune("eval", "--model", m, "--data", data, "--device", "cuda:1", gpus=2, OMPI_COMM_WORLD_LOCAL_RANK=1,
              OMPI_COMM_WORLD_LOCAL_SIZE=4)
    assert p.returncode == 1 and "the launcher starts 4 ranks on this host" in p.stderr, p.stderr
    assert "--device D" in ok(qtune("eval", "--help")).stdout


def test_generate_device(base):
    m = os.path.join(base, "model")
    args = ["generate", "--model", m, "--prompt-ids", "1,2,3", "--max-new", "4", "--temperature", "0", "--json"]
    ids = lambda p: json.loads(p.stdout.splitlines()[-1])["ids"]  # noqa: E731
    assert ids(ok(qtune(*args, "--device", "cpu"))) == ids(ok(qtune(*args, gpus=0)))
    p = qtune(*args, "--device", "cuda:1", gpus=2)
    assert p.returncode == 1 and "asked to open GPU 1 of 2" in p.stderr, p.stderr
    p = qtune(*args, "--device", "cuda", gpus=0)
    assert p.returncode == 1 and '--device "cuda" asks for a GPU' in p.stderr, p.stderr
    p = qtune(*args, "--device", "tpu")
    assert p.returncode == 2 and "--device must be" in p.stderr, p.stderr
    assert "--device D" in ok(qtune("generate", "--help")).stdout


def test_merge_device(base):
    j, out = job(base, "lora", "cpu", lora={"r": 2, "lora_alpha": 4})
    ok(qtune("train", j))
    m, a = os.path.join(base, "model"), os.path.join(out, "final")
    ok(qtune("merge", "--model", m, "--adapter", a, "--out", os.path.join(base, "merged_default"), gpus=0))
    ok(qtune("merge", "--model", m, "--adapter", a, "--out", os.path.join(base, "merged_cpu"), "--device", "cpu"))
    p = ok(qtune("merge", "--model", m, "--adapter", a, "--out", os.path.join(base, "merged_gpu"),
                 "--device", "cuda", gpus=2))
    assert "streams the weights through host memory on the CPU; GPU 0 is not used" in p.stderr, p.stderr
    for d in ("merged_cpu", "merged_gpu"):
        with open(os.path.join(base, d, "model.safetensors"), "rb") as f, \
                open(os.path.join(base, "merged_default", "model.safetensors"), "rb") as g:
            assert f.read() == g.read()
    p = qtune("merge", "--model", m, "--adapter", a, "--out", os.path.join(base, "merged_no"), "--device", "cuda",
              gpus=0)
    assert p.returncode == 1 and '--device "cuda" asks for a GPU' in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(base, "merged_no"))
    p = qtune("merge", "--model", m, "--adapter", a, "--out", os.path.join(base, "merged_no"), "--device", "x")
    assert p.returncode == 2 and "--device must be" in p.stderr, p.stderr
    assert "--device D" in ok(qtune("merge", "--help")).stdout


def test_plan_device_without_the_device(base):
    args = ["plan", "--preset", "tiny", "--mode", "full", "--micro-batch", "2", "--seq-len", "64", "--json"]
    plan = lambda *a, **k: json.loads(ok(qtune(*args, *a, **k)).stdout)  # noqa: E731
    cuda = plan("--device", "cuda", gpus=0)
    cpu = plan("--device", "cpu", gpus=0)
    assert cuda["backend"] == "cuda" and cpu["backend"] == "cpu"
    assert cuda == plan("--backend", "cuda", gpus=0) == plan("--device", "cuda:3", gpus=0)  # --backend still works
    # the CUDA descriptor's 8192-row vocabulary chunks (src/backend/cuda/desc.c) give a larger workspace
    assert cuda["per_device_bytes"]["workspace"] > cpu["per_device_bytes"]["workspace"]
    for k in ("weights", "gradients", "optimizer_state", "activations"):
        assert cuda["per_device_bytes"][k] == cpu["per_device_bytes"][k], k
    # no option: as a run here would choose (auto, QTUNE_BACKEND, the job's device)
    assert plan(gpus=0)["backend"] == "cpu" and plan(gpus=2)["backend"] == "cuda"
    assert plan(gpus=2, QTUNE_BACKEND="guard")["backend"] == "guard"
    assert plan("--device", "cpu", gpus=2, QTUNE_BACKEND="guard")["backend"] == "cpu"
    j, _ = job(base, "plan_cuda", "cuda")
    got = json.loads(ok(qtune("plan", j, "--json", gpus=0)).stdout)
    assert got["backend"] == "cuda"
    text = ok(qtune("plan", "--preset", "tiny", "--device", "cuda")).stdout
    assert "device     cuda (its descriptor sizes the workspaces" in text, text
    p = qtune(*args, "--device", "xpu")
    assert p.returncode == 2 and "--device must be cpu, cuda, cuda:N, npu, npu:N or auto" in p.stderr, p.stderr
    assert "--device D" in ok(qtune("plan", "--help")).stdout


def test_doctor_checks_the_device(base):
    j, _ = job(base, "doc_cuda", "cuda")
    p = qtune("doctor", j, gpus=0)
    assert p.returncode == 1, p.stdout + p.stderr
    assert 'problem: %s: "device": "cuda" asks for a GPU, but no CUDA GPU is visible' % j in p.stdout, p.stdout
    j, _ = job(base, "doc_auto")
    p = ok(qtune("doctor", j, gpus=0))
    assert "device: cpu (1 thread); device auto -> cpu: no CUDA GPU is visible" in p.stdout, p.stdout
    p = ok(qtune("doctor", j, gpus=2))
    assert "device: cuda:0 (Fake GPU 0); device auto -> cuda:0: 2 GPUs visible" in p.stdout, p.stdout


STANDIN = os.path.join(BUILD, "tests", "acl_standin", "libqtune_acl_standin.so")


def test_npu_says_what_it_lacks(base):
    """"device": "npu" (issue 45): without CANN, one sentence naming the library and
    nothing written; on the stand-in of CANN's API (tests/unit/backend_parity/
    acl_standin.c) the run trains, full and LoRA with dropout
    (tests/train/test_npu_train.py holds it to the CPU)"""
    j, out = job(base, "npu", "npu")
    p = qtune("train", j, QTUNE_ASCEND_LIB="")
    assert p.returncode == 1, p.stderr
    assert "libascendcl.so could not be loaded" in p.stderr and "set_env.sh" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not os.path.exists(out)
    p = qtune("eval", "--model", os.path.join(base, "model"), "--data", os.path.join(base, "train.jsonl"),
              "--device", "npu:1", QTUNE_ASCEND_LIB=STANDIN)
    assert p.returncode == 1 and '"npu:1" names NPU 1, but 1 NPU is visible' in p.stderr, p.stderr
    assert os.path.exists(STANDIN), "build the tests first: %s is missing" % STANDIN
    p = qtune("train", j, QTUNE_ASCEND_LIB=STANDIN)
    assert p.returncode == 0, p.stderr
    j, _ = job(base, "npu_dropout", "npu", lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                                                  "target_modules": ["q_proj"]})
    p = qtune("train", j, QTUNE_ASCEND_LIB=STANDIN)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is here: auto may take a GPU before an NPU")
def test_auto_prefers_a_visible_npu(base):
    """"auto" (issue 45): no CUDA GPU, then an Ascend NPU when CANN loads and sees one (here the stand-in of
    CANN's API, QTUNE_ACL_STANDIN_DEVICES of them), the note saying so; CANN absent, or no NPU seen, leaves the
    CPU with the same note as before and not a word about CANN."""
    assert os.path.exists(STANDIN), "build the tests first: %s is missing" % STANDIN
    j, _ = job(base, "auto_npu")
    p = ok(qtune("train", j, QTUNE_ASCEND_LIB=STANDIN, QTUNE_ACL_STANDIN_DEVICES=2))
    assert "| device npu:0" in run_line(p), p.stderr
    assert "qtune: device auto -> npu:0: no CUDA GPU, 2 Ascend NPUs visible" in p.stderr, p.stderr
    for i, env in enumerate(({"QTUNE_ASCEND_LIB": ""}, {"QTUNE_ASCEND_LIB": STANDIN, "QTUNE_ACL_STANDIN_DEVICES": 0})):
        j, _ = job(base, "auto_nocard%d" % i)
        p = ok(qtune("train", j, **env))
        assert "| device cpu (1 thread)" in run_line(p), p.stderr
        assert "qtune: device auto -> cpu: " + why_no_gpu_here() in p.stderr, p.stderr
        quiet = ("CANN", "Ascend", "NPU", "npu:", "libascendcl", "acl", "warning")
        assert not any(w in p.stderr for w in quiet), p.stderr


def test_acl_finalize_at_exit(base):
    """CANN's documentation: aclFinalize before the process exits. The stand-in says on stderr when a process
    that called aclInit exits without it; no run says so: a train, an eval, and a run that stops with an error
    after aclInit (an NPU number past the cards)."""
    assert os.path.exists(STANDIN), "build the tests first: %s is missing" % STANDIN
    j, _ = job(base, "npu_fin", "npu")
    runs = [ok(qtune("train", j, QTUNE_ASCEND_LIB=STANDIN)),
            ok(qtune("eval", "--model", os.path.join(base, "model"), "--data", os.path.join(base, "train.jsonl"),
                     "--device", "npu", QTUNE_ASCEND_LIB=STANDIN)),
            qtune("eval", "--model", os.path.join(base, "model"), "--data", os.path.join(base, "train.jsonl"),
                  "--device", "npu:1", QTUNE_ASCEND_LIB=STANDIN)]
    assert runs[2].returncode == 1 and "names NPU 1" in runs[2].stderr, runs[2].stderr
    for p in runs:
        assert "without aclFinalize" not in p.stderr, p.stderr
