"""Decode speed of `qtune generate` against the PyTorch reference (tests/ref/qwen2_ref.py's weights
and pieces, with a KV cache added here so both sides do the same work per token), greedy, fp32.

usage: /usr/bin/python3 tests/tools/bench_generate.py MODEL_DIR QTUNE_BIN [N_NEW] [THREADS]
Prints both tokens/s and whether the greedy ids agree. Not a ctest test (it takes minutes)."""
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "ref"))
from qwen2_ref import LINEARS, Qwen2Ref  # noqa: E402


def ref_decode(ref, prompt, n):
    """Greedy decoding with a KV cache: prefill the prompt, then one position per step."""
    p, L = ref.p, ref.L
    cache = [[None, None] for _ in range(L)]

    def step(ids, pos0):
        ids = torch.as_tensor([ids])
        T = ids.shape[1]
        pos = torch.arange(pos0, pos0 + T)[None, :]
        x = p["model.embed_tokens.weight"][ids]
        for l in range(L):
            pre = "model.layers.%d." % l
            h = ref.rmsnorm(x, p[pre + "input_layernorm.weight"])
            q = ref.linear(h, l, LINEARS[0]).view(1, T, ref.H, ref.D)
            k = ref.linear(h, l, LINEARS[1]).view(1, T, ref.KV, ref.D)
            v = ref.linear(h, l, LINEARS[2]).view(1, T, ref.KV, ref.D)
            q, k = ref.rope(q, pos), ref.rope(k, pos)
            if cache[l][0] is not None:
                k = torch.cat([cache[l][0], k], 1)
                v = torch.cat([cache[l][1], v], 1)
            cache[l] = [k, v]
            G = ref.H // ref.KV
            kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
            s = torch.einsum("bthd,bjhd->bhtj", q, kk) / ref.D ** 0.5
            S = kk.shape[1]
            mask = torch.arange(S)[None, :] <= (torch.arange(T)[:, None] + pos0)
            s = s.masked_fill(~mask[None, None], float("-inf"))
            a = torch.einsum("bhtj,bjhd->bthd", torch.softmax(s, -1), vv).reshape(1, T, ref.H * ref.D)
            x = x + ref.linear(a, l, LINEARS[3])
            h = ref.rmsnorm(x, p[pre + "post_attention_layernorm.weight"])
            x = x + ref.linear(torch.nn.functional.silu(ref.linear(h, l, LINEARS[4])) * ref.linear(h, l, LINEARS[5]),
                               l, LINEARS[6])
        x = ref.rmsnorm(x[:, -1:], p["model.norm.weight"])
        w = p["model.embed_tokens.weight"] if ref.tied else p["lm_head.weight"]
        return (x @ w.T)[0, -1]

    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = int(torch.argmax(step(prompt, 0)))
        t1 = time.perf_counter()
        out = [nxt]
        for i in range(n - 1):
            nxt = int(torch.argmax(step([nxt], len(prompt) + i)))
            out.append(nxt)
        t2 = time.perf_counter()
    return out, t1 - t0, (n - 1) / (t2 - t1)


def main():
    model, qtune = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    threads = sys.argv[4] if len(sys.argv) > 4 else "2"
    prompt = [9707, 11, 358, 1079, 264, 1614, 1614, 315, 279, 3460, 13, 576, 6722, 315, 9625, 374]
    env = dict(os.environ, OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    r = subprocess.run([qtune, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
                        "--temperature", "0", "--max-new", str(n), "--ctx", "256", "--json"],
                       capture_output=True, text=True, env=env, check=True)
    q = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"qtune:     prefill {len(prompt)} tokens {q['prefill_s']:.3f} s, decode {q['decode_tokens_per_s']:.2f} tokens/s")
    torch.set_num_threads(int(threads))
    ref = Qwen2Ref(model, dtype=torch.float32)
    ids, pre, tps = ref_decode(ref, prompt, n)
    print(f"reference: prefill {len(prompt)} tokens {pre:.3f} s, decode {tps:.2f} tokens/s (torch {torch.__version__}, "
          f"{threads} threads)")
    same = sum(1 for a, b in zip(ids, q["ids"]) if a == b)
    print(f"greedy ids agree on {same}/{n} (first difference at {next((i for i, (a, b) in enumerate(zip(ids, q['ids'])) if a != b), None)})")


if __name__ == "__main__":
    main()
