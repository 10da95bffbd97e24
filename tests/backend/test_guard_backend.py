"""The guard backend (QTUNE_BACKEND=guard, src/backend/guard/): the CPU kernels
with device memory the host cannot touch. Training (LoRA with dropout, full
fp16 with checkpointing, a resume from a checkpoint, lora.init_from), eval with
per-token log-probabilities, generate with the KV cache and merge run on it,
and must give the cpu backend's results bit for bit: a host read or write of
tensor memory left outside src/backend/ would crash the guard run at its line
(SIGSEGV), and a wrong upload/download would change the numbers."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
from trainutil import QTUNE, init_model, write_job, write_tokens  # noqa: E402

# memory figures: the guard also reports its device peak (device_peak_bytes), the cpu has none
TIMING = {"tokens_per_s", "elapsed_s", "mem_peak_bytes", "comm_s", "device_peak_bytes"}


def qtune(backend, *args):
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", QTUNE_BACKEND=backend)
    e.pop("QTUNE_LOG", None)
    p = subprocess.run([QTUNE] + [str(a) for a in args], capture_output=True, text=True, env=e, timeout=600)
    assert p.returncode == 0, "%s backend: qtune %s failed (%d)\n%s\n%s" % (
        backend, " ".join(map(str, args)), p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def same_files(a, b, names):
    for n in names:
        assert open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read(), n


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("guard"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    write_tokens(os.path.join(d, "eval.jsonl"), 6, 16, seed=2)
    return d


def train_both(base, name, **kw):
    outs = {}
    for be in ("cpu", "guard"):
        out = os.path.join(base, "%s-%s" % (name, be))
        shutil.rmtree(out, ignore_errors=True)
        j = write_job(os.path.join(base, "%s-%s.json" % (name, be)), os.path.join(base, "model"), out,
                      os.path.join(base, "train.jsonl"), eval_=os.path.join(base, "eval.jsonl"), **kw)
        qtune(be, "train", j)
        outs[be] = out
    assert steps(outs["cpu"]) == steps(outs["guard"])
    return outs


LORA = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_lora_train_eval_generate_merge(base):
    outs = train_both(base, "lora", lora=LORA, data_opts={"shuffle": True},
                      train_opts={"max_steps": 4, "save_steps": 2, "eval_steps": 2})
    same_files(os.path.join(outs["cpu"], "final"), os.path.join(outs["guard"], "final"),
               ["adapter_model.safetensors", "adapter_config.json"])
    same_files(os.path.join(outs["cpu"], "checkpoint-2"), os.path.join(outs["guard"], "checkpoint-2"),
               ["adapter_model.safetensors", "optimizer-00000-of-00001.safetensors"])
    model, adapter = os.path.join(base, "model"), os.path.join(outs["cpu"], "final")
    r = {}
    for be in ("cpu", "guard"):
        tok = os.path.join(base, "pt-%s.jsonl" % be)
        ev = qtune(be, "eval", "--model", model, "--adapter", adapter, "--data", os.path.join(base, "eval.jsonl"),
                   "--batch", 2, "--seq-len", 16, "--per-token", tok)
        gen = qtune(be, "generate", "--model", model, "--adapter", adapter, "--prompt-ids", "5,6,7,8",
                    "--max-new", 6, "--temperature", 0.8, "--top-k", 20, "--seed", 3, "--json")
        mout = os.path.join(base, "merged-%s" % be)
        shutil.rmtree(mout, ignore_errors=True)
        qtune(be, "merge", "--model", model, "--adapter", adapter, "--out", mout)
        r[be] = (ev.stdout.strip().splitlines()[-1], open(tok).read(),
                 [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")}
                  for x in gen.stdout.strip().splitlines()], open(os.path.join(mout, "model.safetensors"), "rb").read())
    assert r["cpu"] == r["guard"]


def test_full_fp16_checkpointing_and_resume(base):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}, "gradient_clipping": 1.0}
    outs = train_both(base, "full", ds=ds, train_opts={"max_steps": 4, "save_steps": 2, "gradient_checkpointing": True})
    same_files(os.path.join(outs["cpu"], "final"), os.path.join(outs["guard"], "final"), ["model.safetensors"])
    # resume on the guard from the cpu run's checkpoint-2 == the straight cpu run
    out = os.path.join(base, "full-resumed")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(outs["cpu"], out)
    for n in os.listdir(out):
        if n not in ("checkpoint-2", "qtune_run.json", "metrics.jsonl"):
            shutil.rmtree(os.path.join(out, n)) if os.path.isdir(os.path.join(out, n)) else os.remove(
                os.path.join(out, n))
    j = write_job(os.path.join(base, "full-resumed.json"), os.path.join(base, "model"), out,
                  os.path.join(base, "train.jsonl"), eval_=os.path.join(base, "eval.jsonl"), ds=ds,
                  train_opts={"max_steps": 4, "save_steps": 2, "gradient_checkpointing": True, "resume": "auto"})
    qtune("guard", "train", j)
    same_files(os.path.join(outs["cpu"], "final"), os.path.join(out, "final"), ["model.safetensors"])


def test_init_from_adapter(base):
    src = os.path.join(base, "lora-cpu", "final")
    if not os.path.isdir(src):
        pytest.skip("needs test_lora_train_eval_generate_merge's adapter")
    lora = dict(LORA, init_from=src, lora_dropout=0.0)
    train_both(base, "init", lora=lora, train_opts={"max_steps": 2})


def test_unknown_backend_is_refused(base):
    e = dict(os.environ, QTUNE_BACKEND="tpu")
    p = subprocess.run([QTUNE, "eval", "--model", os.path.join(base, "model"), "--data",
                        os.path.join(base, "eval.jsonl"), "--seq-len", "16"], capture_output=True, text=True, env=e)
    assert p.returncode != 0
    assert 'backend "tpu" is not compiled in' in p.stderr


def test_plan_reads_a_backends_descriptor(base):
    """qtune plan sizes workspaces from a backend's descriptor without opening it."""
    args = ["plan", "--preset", "tiny", "--mode", "full", "--micro-batch", "2", "--seq-len", "64", "--json"]
    cpu = json.loads(qtune("cpu", *args, "--backend", "cpu").stdout)
    guard = json.loads(qtune("cpu", *args, "--backend", "guard").stdout)
    assert cpu.pop("backend") == "cpu" and guard.pop("backend") == "guard"
    assert cpu == guard  # the guard runs the cpu's kernels: the same facts
    e = dict(os.environ)
    p = subprocess.run([QTUNE] + args + ["--backend", "tpu"], capture_output=True, text=True, env=e)
    assert p.returncode == 2 and "--backend must name a compiled-in backend" in p.stderr, p.stderr


def test_profile_wrapper_times_every_op_and_changes_nothing(base):
    """QTUNE_PROFILE=1 wraps the backend (src/backend/profile.c): a LoRA training run on the guard backend
    gives the plain run's losses bit for bit, and stderr ends with the per-op table, one row per op used."""
    outs = {}
    for prof in ("0", "1"):
        out = os.path.join(base, "prof-" + prof)
        shutil.rmtree(out, ignore_errors=True)
        j = write_job(os.path.join(base, "prof-%s.json" % prof), os.path.join(base, "model"), out,
                      os.path.join(base, "train.jsonl"), lora=LORA)
        e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", QTUNE_BACKEND="guard",
                 QTUNE_PROFILE=prof)
        p = subprocess.run([QTUNE, "train", j], capture_output=True, text=True, env=e, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[prof] = (out, p.stderr)
    assert steps(outs["0"][0]) == steps(outs["1"][0])
    assert "QTUNE_PROFILE" not in outs["0"][1]
    err = outs["1"][1]
    assert "profile of the guard backend (QTUNE_PROFILE)" in err
    rows = {l.split()[0]: l.split() for l in err.splitlines() if l.startswith("  ") and len(l.split()) == 5}
    for op in ("matmul_forward", "matmul_backward", "attention_forward", "attention_backward", "dropout", "adam"):
        assert op in rows and int(rows[op][1]) > 0, (op, err[-2000:])
    assert any(op.startswith("lmhead_ce_") for op in rows), err[-2000:]
