"""scripts/gpu-check's benchmark: qtune training on one NVIDIA GPU against the
same steps in PyTorch (+ PEFT for LoRA) on the same GPU, and against the GPU's
dense bf16 peak measured in the same run (an 8192^3 bf16 torch.matmul, the
median of 10 after 3 warm-ups).

Cases: shapes qwen2.5-0.5b and qwen2.5-1.5b (random weights, `qtune init`),
LoRA (r 8, alpha 16, q_proj + v_proj) and full fine-tuning, bf16 and fp16
(dynamic loss scale), micro-batch B x seq_len T of random token ids, AdamW,
clipping 1.0, no checkpoints. tok/s is the median over the steps after the
warm-up ones. MFU = model FLOPs per step (bench_speed.flops_per_step, the
same formula as the CPU benchmark) x steps/s / the measured bf16 peak.

PyTorch's side: transformers' Qwen2ForCausalLM from the same folder, sdpa
attention, torch.autocast in the precision (fp16 with torch.amp.GradScaler),
fp32 master weights, AdamW(fused=True); LoRA through peft where installed.

--ab-env NAME=VALUE also runs each qtune case with that variable set (an
A/B of one of qtune's switches in the same run, e.g. QTUNE_CUDA_LMHEAD=all:
the lm_head's dx and dW on the tensor cores as well as its logits), right
after the plain run, and adds its column.

usage: python3 bench/gpu_bench.py --qtune BIN --out DIR [--shapes ...] [--steps N] [--warmup W] [--B 4 --T 512]
       [--ab-env NAME=VALUE]
Writes DIR/gpu-bench.json and prints a markdown table."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_speed as bs  # noqa: E402  (write_job, flops_per_step, ensure_data)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def bf16_peak():
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * 8192 ** 3 / statistics.median(ts)


def run_qtune(qtune, work, model, data, B, T, mode, precision, warmup, steps, extra_env=None):
    tag = "%s-%s-%s%s" % (os.path.basename(model), mode, precision, "-ab" if extra_env else "")
    job, out = os.path.join(work, tag + ".json"), os.path.join(work, "run-" + tag)
    bs.write_job(job, model, out, data, B, T, warmup + steps, mode, precision)
    with open(job) as f:
        j = json.load(f)
    j["device"] = "cuda"
    with open(job, "w") as f:
        json.dump(j, f, indent=1)
    env = dict(os.environ, QTUNE_BACKEND="cuda", **(extra_env or {}))
    t0 = time.time()
    r = subprocess.run([qtune, "train", job], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1], "rc": r.returncode}
    st = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in x]
    meas = st[warmup:]
    return {"tok_s": statistics.median([x["tokens_per_s"] for x in meas]) if meas else None,
            "loss": [x.get("loss") for x in st], "mem_peak_bytes": max(x.get("mem_peak_bytes", 0) for x in st),
            "wall_s": time.time() - t0}


def run_torch(model, data, B, T, mode, precision, warmup, steps):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    dt = torch.bfloat16 if precision == "bf16" else torch.float16
    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32, attn_implementation="sdpa").cuda()
    if mode == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            return {"error": "peft is not installed"}
        m = get_peft_model(m, LoraConfig(r=bs.LORA_R, lora_alpha=bs.LORA_ALPHA, lora_dropout=0.0,
                                         target_modules=["q_proj", "v_proj"]))
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    rows = [json.loads(x)["input_ids"] for x in open(data)][: B * (warmup + steps)]
    ids_all = torch.tensor(np.array(rows), dtype=torch.long, device="cuda")
    times = []
    for s in range(warmup + steps):
        ids = ids_all[s * B:(s + 1) * B]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=dt):
            loss = m(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del m, opt
    torch.cuda.empty_cache()
    return {"tok_s": B * T / statistics.median(times[warmup:]), "torch": torch.__version__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtune", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--precisions", default="bf16,fp16")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ab-env", default=None, help="NAME=VALUE: each qtune case also runs with it set")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    peak = bf16_peak()
    log("bf16 peak (torch.matmul 8192^3, median of 10): %.1f TFLOP/s" % (peak / 1e12))
    res = {"bf16_peak_flops": peak, "B": a.B, "T": a.T, "cases": []}
    for shape in a.shapes.split(","):
        model, cfg = bs.ensure_model(a.qtune, work, shape)
        data = bs.ensure_data(work, cfg["vocab_size"], a.T, a.B * (a.warmup + a.steps))
        for mode in a.modes.split(","):
            fl, _ = bs.flops_per_step(cfg, a.B, a.T, mode)
            for prec in a.precisions.split(","):
                log("case %s %s %s" % (shape, mode, prec))
                q = run_qtune(a.qtune, work, model, data, a.B, a.T, mode, prec, a.warmup, a.steps)
                qab = run_qtune(a.qtune, work, model, data, a.B, a.T, mode, prec, a.warmup, a.steps,
                                dict([a.ab_env.split("=", 1)])) if a.ab_env else None
                t = {"not_run": True} if a.no_torch else run_torch(model, data, a.B, a.T, mode, prec, a.warmup,
                                                                  a.steps)
                case = {"shape": shape, "mode": mode, "precision": prec, "gflop_per_step": fl / 1e9, "qtune": q,
                        "torch": t}
                if qab is not None:
                    case["qtune_ab"], case["ab_env"] = qab, a.ab_env
                for k in ("qtune", "torch", "qtune_ab"):
                    if k in case and case[k].get("tok_s"):
                        case[k]["mfu"] = fl * case[k]["tok_s"] / (a.B * a.T) / peak
                res["cases"].append(case)
                with open(os.path.join(a.out, "gpu-bench.json"), "w") as f:
                    json.dump(res, f, indent=1)
    ab = " | qtune with %s tok/s | qtune / that" % a.ab_env if a.ab_env else ""
    print("| shape | mode | precision | qtune tok/s | qtune MFU | PyTorch tok/s | PyTorch MFU | qtune / PyTorch%s |" % ab)
    print("|---|---|---|---|---|---|---|---|%s" % ("---|---|" if a.ab_env else ""))
    for c in res["cases"]:
        q, t = c["qtune"], c["torch"]
        fmt = lambda r, k, f: (f % r[k]) if r.get(k) else (r.get("error", "-")[:60] if k == "tok_s" else "-")
        ratio = "%.2f" % (q["tok_s"] / t["tok_s"]) if q.get("tok_s") and t.get("tok_s") else "-"
        abc = ""
        if "qtune_ab" in c:
            qa = c["qtune_ab"]
            abc = " | %s | %s" % (fmt(qa, "tok_s", "%.0f"), "%.2f" % (q["tok_s"] / qa["tok_s"])
                                  if q.get("tok_s") and qa.get("tok_s") else "-")
        print("| %s | %s | %s | %s | %s | %s | %s | %s%s |" % (
            c["shape"], c["mode"], c["precision"], fmt(q, "tok_s", "%.0f"), fmt(q, "mfu", "%.3f"),
            fmt(t, "tok_s", "%.0f"), fmt(t, "mfu", "%.3f"), ratio, abc))


if __name__ == "__main__":
    main()
