"""qtune's Adam/AdamW and gradient clipping against torch.optim.AdamW /
torch.optim.Adam and torch.nn.utils.clip_grad_norm_, on a small flat block
with a weight-decay group and a no-decay group (HF Trainer grouping)."""
import numpy as np
import pytest
import torch

from optim_probe import run

N = 96
N_DECAY = 60  # the first 60 elements are "2-D weights", the rest biases/norms


def fmt(a):
    return " ".join(repr(float(x)) for x in a)


def torch_run(cls, p0, grads, lr, betas, eps, wd):
    w = torch.tensor(p0[:N_DECAY].copy(), requires_grad=True)
    b = torch.tensor(p0[N_DECAY:].copy(), requires_grad=True)
    opt = cls([{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}], lr=lr, betas=betas,
              eps=eps, foreach=False)
    out = []
    for g in grads:
        w.grad = torch.tensor(g[:N_DECAY].copy())
        b.grad = torch.tensor(g[N_DECAY:].copy())
        opt.step()
        out.append(np.concatenate([w.detach().numpy(), b.detach().numpy()]).copy())
    return out


def probe_run(decoupled, p0, grads, lr, betas, eps, wd, shards=1):
    flags = np.zeros(N, dtype=np.float32)
    flags[:N_DECAY] = 1
    stdin = fmt(p0) + "\n" + fmt(flags) + "\n" + "\n".join(fmt(g) for g in grads) + "\n"
    out = run(["adam", decoupled, lr, betas[0], betas[1], eps, wd, len(grads), N, shards], stdin)
    assert not out.startswith("error"), out
    return [np.array([float(x) for x in line.split()], dtype=np.float32) for line in out.splitlines()]


def data(seed, steps):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = [(rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32) for _ in range(steps)]
    grads[1][5] = 0.0  # an exact zero gradient element
    return p0, grads


@pytest.mark.parametrize("decoupled,wd,shards", [(1, 0.1, 1), (1, 0.0, 1), (0, 0.05, 1), (1, 0.1, 3), (0, 0.05, 4)])
def test_adam_matches_torch(decoupled, wd, shards):
    lr, betas, eps = 1e-2, (0.9, 0.95), 1e-6
    p0, grads = data(42 + shards, 6)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    want = torch_run(cls, p0, grads, lr, betas, eps, wd)
    got = probe_run(decoupled, p0, grads, lr, betas, eps, wd, shards)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        # fp32 arithmetic in a possibly different order (FMA): a few ulps
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7, err_msg=f"step {step}")
    # the decay really acted: with wd the decayed block differs from a wd = 0 run
    if wd:
        plain = torch_run(cls, p0, grads, lr, betas, eps, 0.0)
        assert np.abs(plain[-1][:N_DECAY] - got[-1][:N_DECAY]).max() > 1e-5
        np.testing.assert_allclose(got[-1][N_DECAY:], plain[-1][N_DECAY:], rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("max_norm,scale", [(1.0, 1.0), (100.0, 1.0), (0.5, 1024.0), (0.0, 1.0)])
def test_clip_matches_torch(max_norm, scale):
    rng = np.random.default_rng(7)
    g = rng.standard_normal(N).astype(np.float32)
    scaled = (g * np.float32(scale)).astype(np.float32)
    out = run(["clip", max_norm, 1.0 / scale, N], fmt(scaled)).splitlines()
    norm, nonfinite = out[0].split()
    got = np.array([float(x) for x in out[1].split()], dtype=np.float32)
    t = torch.tensor(g.copy(), requires_grad=True)
    t.grad = torch.tensor(g.copy())
    if max_norm > 0:
        want_norm = float(torch.nn.utils.clip_grad_norm_([t], max_norm))
    else:
        want_norm = float(torch.linalg.vector_norm(t.grad))
    assert int(nonfinite) == 0
    assert float(norm) == pytest.approx(want_norm, rel=1e-6)
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_nonfinite_grad_reported_and_left_alone():
    g = np.ones(N, dtype=np.float32)
    g[N - 1] = np.inf
    out = run(["clip", 1.0, 1.0, N], fmt(g)).splitlines()
    norm, nonfinite = out[0].split()
    assert float(norm) == float("inf") and int(nonfinite) == 1
    assert [float(x) for x in out[1].split()][:3] == [1.0, 1.0, 1.0]
