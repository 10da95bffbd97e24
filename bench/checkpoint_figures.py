#!/usr/bin/python3
"""Checkpoint figures for bench/RESULTS-checkpoint.md, for one or more qtune
binaries (e.g. main's and a branch's):

  rss:   2 ranks under mpirun, ZeRO-2 + offload, 11.5M trainable values
         (full m + v: 88 MiB), reduce/allgather buckets of 1e6, a checkpoint
         at each of 2 steps: each rank's peak RSS (ru_maxrss of the qtune
         process, read by a small wrapper around each rank).
  final: 1 rank, full fine-tuning of a 96.5M-parameter fp32 model for 1 step:
         seconds from "saved checkpoint-1" to "wrote final" (the debug log),
         bytes the process wrote (/usr/bin/time's file-system outputs), and
         the link count of final/model.safetensors.

usage: bench/checkpoint_figures.py [--runs N] QTUNE [QTUNE ...]
Needs mpirun, /usr/bin/time, numpy; writes under a temporary folder."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "train"))
import trainutil as u  # noqa: E402

MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "torch_dtype": "float32"}


def model(q, d, **shape):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "cfg.json"), "w") as f:
        json.dump(dict(QWEN2, **shape), f)
    subprocess.run([q, "init", "--out", os.path.join(d, "model"), "--config", os.path.join(d, "cfg.json"),
                    "--seed", "1", "--force"], check=True, capture_output=True)


def rss(q, d):
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}}
    j = u.write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=16,
                    train_opts={"max_steps": 2, "save_steps": 1}, ds=ds)
    subprocess.run(["rm", "-rf", os.path.join(d, "out")], check=True)
    wrap = ("import os, resource, subprocess, sys\nrc = subprocess.call(sys.argv[1:])\n"
            "open(os.path.join(%r, 'rss.' + os.environ['OMPI_COMM_WORLD_RANK']), 'w')"
            ".write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\nsys.exit(rc)\n" % d)
    p = subprocess.run(MPI + ["-np", "2", sys.executable, "-c", wrap, q, "train", j], capture_output=True, text=True,
                       env=u.env())
    if p.returncode:
        raise SystemExit(p.stdout + p.stderr)
    return [int(open(os.path.join(d, "rss.%d" % r)).read()) / 1024 for r in (0, 1)]


def final(q, d):
    j = u.write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", T=16, train_opts={"max_steps": 1},
                    ds={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    subprocess.run(["rm", "-rf", os.path.join(d, "out")], check=True)
    e = dict(u.env(), QTUNE_LOG="debug")
    p = subprocess.Popen(["/usr/bin/time", "-f", "@@time %O", q, "train", j], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True, env=e)
    t_saved = t_final = blocks = None
    for line in p.stderr:
        now = time.monotonic()
        if "saved " in line:
            t_saved = now
        elif "wrote " in line and "final" in line:
            t_final = now
        elif line.startswith("@@time"):
            blocks = int(line.split()[1])
    if p.wait():
        raise SystemExit("qtune train failed")
    nlink = os.stat(os.path.join(d, "out", "final", "model.safetensors")).st_nlink
    return t_final - t_saved, blocks * 512 / 1e9, nlink


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("qtune", nargs="+")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small, big = os.path.join(tmp, "small"), os.path.join(tmp, "big")
        model(a.qtune[0], small, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
              num_hidden_layers=4, num_key_value_heads=2, vocab_size=512)
        u.write_tokens(os.path.join(small, "train.jsonl"), 16, 16, 1)
        model(a.qtune[0], big, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
              num_hidden_layers=8, num_key_value_heads=2, vocab_size=8192)
        u.write_tokens(os.path.join(big, "train.jsonl"), 8, 16, 1)
        print("load average before: %s" % open("/proc/loadavg").read().strip())
        for q in a.qtune:
            for r in range(a.runs):
                r0, r1 = rss(q, small)
                s, gb, nlink = final(q, big)
                print("%s run %d: peak RSS rank 0 %.1f MiB, rank 1 %.1f MiB | saved->final %.3f s, "
                      "written %.2f GB, final/model.safetensors nlink %d" % (q, r + 1, r0, r1, s, gb, nlink))
        print("load average after: %s" % open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main()
