"""PyTorch side of bench/run: trains the same model folder on the same
pre-tokenized rows as the qtune job, with the reference Qwen2 of tests/ref
(fp32, eager attention as HF's "eager" path), and prints one JSON line with
each step's wall time.

One step = batch tensors -> forward -> summed cross-entropy / labelled tokens
-> backward -> clip_grad_norm_(1.0) -> AdamW.step -> zero_grad, the same work
as one qtune optimizer step (gradient_accumulation_steps 1, no eval, no save).
step_cpu_s: time.process_time() per step (CPU seconds of all threads).
LoRA: r, alpha on q_proj + v_proj, dropout 0, base weights frozen
(requires_grad False), so autograd skips their weight gradients as PEFT does.
Threads: the caller sets OMP_NUM_THREADS / OPENBLAS_NUM_THREADS; this script
also calls torch.set_num_threads(--threads).

usage: /usr/bin/python3 bench/torch_train.py --model DIR --data FILE.jsonl --B 4 --T 256
       --steps 5 --threads 1 [--lora R ALPHA]"""
import argparse
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ref"))
from qwen2_ref import Qwen2Ref  # noqa: E402


def load_rows(path, T, need):
    rows = []
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["input_ids"][:T]
            if len(ids) == T:
                rows.append(ids)
            if len(rows) == need:
                break
    if len(rows) < need:
        sys.exit("%s: needs %d rows of %d tokens, has %d" % (path, need, T, len(rows)))
    return np.array(rows, dtype=np.int64)


def lora_weights(cfg, r, seed):
    """PEFT's init: A kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B zeros."""
    C = cfg["hidden_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    D = cfg.get("head_dim") or C // H
    rng = np.random.default_rng(seed)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for name, out in (("q_proj", H * D), ("v_proj", KV * D)):
            pre = "base_model.model.model.layers.%d.self_attn.%s" % (l, name)
            w[pre + ".lora_A.weight"] = rng.uniform(-1 / math.sqrt(C), 1 / math.sqrt(C), (r, C)).astype(np.float32)
            w[pre + ".lora_B.weight"] = np.zeros((out, r), np.float32)
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--B", type=int, required=True)
    ap.add_argument("--T", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--lora", type=float, nargs=2, metavar=("R", "ALPHA"))
    ap.add_argument("--lr", type=float, default=1e-4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    lora = None
    if a.lora:
        r = int(a.lora[0])
        lora = {"r": r, "alpha": a.lora[1], "targets": ["q_proj", "v_proj"], "weights": lora_weights(cfg, r, 0)}
    t0 = time.perf_counter()
    ref = Qwen2Ref(a.model, dtype=torch.float32, lora=lora)
    if lora:
        for p in ref.p.values():
            p.requires_grad_(False)
    params = list(ref.trainables().values())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    load_s = time.perf_counter() - t0
    rows = load_rows(a.data, a.T, a.B * a.steps)
    V = cfg["vocab_size"]
    times, cpu, losses = [], [], []
    for s in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = torch.from_numpy(rows[s * a.B:(s + 1) * a.B])
        tgt = torch.full_like(ids, -100)
        tgt[:, :-1] = ids[:, 1:]  # the label of position t is token t+1 (HF's shift)
        logits = ref.logits(ids)
        n = int((tgt != -100).sum())
        loss = F.cross_entropy(logits.view(-1, V), tgt.view(-1), ignore_index=-100, reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss))
    print(json.dumps({"step_s": times, "step_cpu_s": cpu, "loss": losses, "load_s": load_s,
                      "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
