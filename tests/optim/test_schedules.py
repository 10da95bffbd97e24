"""qtune's DeepSpeed schedules against an independent Python version of
deepspeed/runtime/lr_schedules.py (WarmupLR, WarmupDecayLR, WarmupCosineLR),
written as DeepSpeed's classes are: a scheduler object with
last_batch_iteration, get_lr() and step(), driving an optimizer's lr."""
import math

import pytest

from optim_probe import run

TYPES = {"WarmupLR": 1, "WarmupDecayLR": 2, "WarmupCosineLR": 3}


class FakeOptimizer:
    def __init__(self, lr):
        self.param_groups = [{"lr": lr}]


class WarmupLR:
    def __init__(self, opt, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log"):
        self.opt = opt
        if warmup_max_lr is None:
            warmup_max_lr = opt.param_groups[0]["lr"]
        self.min_lr = warmup_min_lr
        self.delta = warmup_max_lr - warmup_min_lr
        self.warmup = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inv_log = 1.0 / math.log(self.warmup)
        self.last_batch_iteration = -1
        opt.param_groups[0]["lr"] = self.get_lr()

    def gamma(self):
        it = self.last_batch_iteration
        if it < self.warmup:
            if self.warmup_type == "log":
                return self.inv_log * math.log(it + 1)
            return it / self.warmup
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + self.delta * self.gamma()

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()


class WarmupDecayLR(WarmupLR):
    def __init__(self, opt, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
        self.total = total_num_steps
        super().__init__(opt, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self):
        it = self.last_batch_iteration
        if it < self.warmup:
            return super().gamma()
        return max(0.0, float(self.total - it) / float(max(1.0, self.total - self.warmup)))


class WarmupCosineLR:
    def __init__(self, opt, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log"):
        self.opt = opt
        self.total = total_num_steps
        self.wmin = warmup_min_ratio
        self.cmin = cos_min_ratio
        self.warmup = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inv_log = 1.0 / math.log(self.warmup)
        self.org_lr = opt.param_groups[0]["lr"]
        self.last_batch_iteration = -1
        opt.param_groups[0]["lr"] = self.get_lr()

    def ratio(self):
        it = self.last_batch_iteration
        if it < self.warmup:
            r = self.inv_log * math.log(it + 1) if self.warmup_type == "log" else it / self.warmup
            return self.wmin + r * (1.0 - self.wmin)
        real_last = it - self.warmup + 1
        real_total = self.total - self.warmup
        r = (1 + math.cos(math.pi * real_last / real_total)) / 2
        return max(0.0, self.cmin + (1.0 - self.cmin) * r)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return 0.0
        return self.org_lr * self.ratio()

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()


def probe_lrs(name, base_lr, min_lr, max_lr, warmup, wtype, total, wmin, cmin, n):
    out = run(["sched", TYPES[name], base_lr, min_lr, max_lr, warmup, wtype, total, wmin, cmin, n])
    assert not out.startswith("error"), out
    return [float(x) for x in out.split()]


CASES = [
    # name, base_lr, kwargs, steps
    ("WarmupLR", 1e-3, dict(warmup_min_lr=1e-5, warmup_max_lr=2e-3, warmup_num_steps=10, warmup_type="log"), 25),
    ("WarmupLR", 1e-3, dict(warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=7, warmup_type="linear"), 20),
    ("WarmupLR", 3e-4, dict(warmup_min_lr=0.0, warmup_max_lr=3e-4, warmup_num_steps=0, warmup_type="log"), 6),
    ("WarmupLR", 3e-4, dict(warmup_min_lr=1e-6, warmup_max_lr=3e-4, warmup_num_steps=1, warmup_type="linear"), 6),
    ("WarmupDecayLR", 1e-3, dict(total_num_steps=50, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10,
                                 warmup_type="log"), 60),
    ("WarmupDecayLR", 1e-3, dict(total_num_steps=40, warmup_min_lr=1e-5, warmup_max_lr=5e-4, warmup_num_steps=8,
                                 warmup_type="linear"), 45),
    ("WarmupDecayLR", 1e-3, dict(total_num_steps=5, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10,
                                 warmup_type="linear"), 15),
    ("WarmupCosineLR", 6e-5, dict(total_num_steps=50, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=1e-4,
                                  warmup_type="log"), 60),
    ("WarmupCosineLR", 1e-3, dict(total_num_steps=30, warmup_min_ratio=0.0, warmup_num_steps=5, cos_min_ratio=0.05,
                                  warmup_type="linear"), 35),
    ("WarmupCosineLR", 1e-3, dict(total_num_steps=12, warmup_min_ratio=0.0, warmup_num_steps=1, cos_min_ratio=0.0,
                                  warmup_type="linear"), 14),
]


def make(name, base_lr, kw):
    opt = FakeOptimizer(base_lr)
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[name]
    return opt, cls(opt, **kw)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_schedule_matches_deepspeed(case):
    name, base_lr, kw, n = case
    opt, sched = make(name, base_lr, kw)
    min_lr = kw.get("warmup_min_lr", 0.0)
    max_lr = kw.get("warmup_max_lr", base_lr)
    got = probe_lrs(name, base_lr, min_lr, max_lr, kw["warmup_num_steps"], kw["warmup_type"],
                    kw.get("total_num_steps", -1), kw.get("warmup_min_ratio", 0.0), kw.get("cos_min_ratio", 1e-4), n)
    assert len(got) == n + 2
    # got[k] = lr at last_batch_iteration = k - 1; the optimizer's lr as the
    # engine drives it: built (it = -1), then one step() per applied update.
    want = [opt.param_groups[0]["lr"]]
    for _ in range(n + 1):
        sched.step()
        want.append(opt.param_groups[0]["lr"])
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-13, abs=1e-18), f"{name} it={k - 1}: qtune {g!r}, DeepSpeed {w!r}"


def test_warmup_boundaries_exact():
    # the last warmup step and the first step after it, by hand
    got = probe_lrs("WarmupLR", 1e-3, 0.0, 1e-3, 10, "linear", -1, 0.0, 1e-4, 11)
    assert got[0] == 0.0            # it = -1
    assert got[1] == 0.0            # it = 0
    assert got[10] == pytest.approx(1e-3 * 9 / 10, rel=1e-15)  # it = 9
    assert got[11] == 1e-3          # it = 10: warmup done
    got = probe_lrs("WarmupCosineLR", 1.0, 0.0, 1.0, 10, "linear", 20, 0.0, 0.0, 21)
    assert got[11] == pytest.approx((1 + math.cos(math.pi * 1 / 10)) / 2, rel=1e-15)  # it = 10
    assert got[20] == pytest.approx(0.0, abs=1e-15)  # it = 19: real_last = total - warmup
    assert got[0] == 0.0


def test_cosine_equal_total_and_warmup_is_an_error():
    out = run(["sched", 3, 1e-3, 0, 1e-3, 10, "log", 10, 0, 1e-4, 3])
    assert out.startswith("error") and "total_num_steps" in out
