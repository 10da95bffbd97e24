"""qtune's fp16 loss scaler against an independent Python version of
DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py),
fed the same random overflow sequences of 500 steps."""
import random

import pytest

from optim_probe import run


class FloorError(Exception):
    pass


class DynamicLossScaler:
    """DeepSpeed's rules: scale_factor 2, delayed_shift = hysteresis."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloorError()
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


CONFIGS = [
    # power, window, hysteresis, min_scale, consecutive, p(overflow), seed
    (16, 20, 2, 1, 0, 0.10, 1),
    (16, 1000, 2, 1, 0, 0.01, 2),   # DeepSpeed's defaults
    (8, 10, 3, 1, 1, 0.25, 3),
    (6, 7, 1, 2, 0, 0.15, 4),       # likely to reach the floor: the error path
    (4, 5, 2, 4, 0, 0.30, 5),
    (12, 3, 4, 0.5, 1, 0.40, 6),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_random_sequence_matches_deepspeed(cfg):
    power, window, hyst, min_scale, consec, p, seed = cfg
    rng = random.Random(seed)
    seq = [1 if rng.random() < p else 0 for _ in range(500)]
    ref = DynamicLossScaler(2.0 ** power, window, min_scale, hyst, bool(consec))
    want = []
    floor_at = None
    for i, o in enumerate(seq):
        try:
            ref.update_scale(o)
        except FloorError:
            floor_at = i
            break
        want.append((ref.cur_scale, ref.cur_hysteresis))
    out = run(["scaler", power, window, hyst, min_scale, consec, 0], "".join(map(str, seq))).splitlines()
    got = []
    err = None
    for line in out:
        if line.startswith("error"):
            err = line
            break
        s, h = line.split()
        got.append((float(s), int(h)))
    assert got == want
    if floor_at is None:
        assert err is None and len(got) == 500
    else:
        assert err is not None and len(got) == floor_at
        assert "lower the learning rate" in err and "bf16" in err


def test_error_path_is_exercised():
    # at least one configuration above must reach the floor, or the error
    # comparison never ran
    hit = False
    for power, window, hyst, min_scale, consec, p, seed in CONFIGS:
        rng = random.Random(seed)
        ref = DynamicLossScaler(2.0 ** power, window, min_scale, hyst, bool(consec))
        try:
            for _ in range(500):
                ref.update_scale(1 if rng.random() < p else 0)
        except FloorError:
            hit = True
    assert hit


def test_static_scale_never_moves():
    rng = random.Random(9)
    seq = "".join("1" if rng.random() < 0.3 else "0" for _ in range(500))
    out = run(["scaler", 16, 10, 2, 1, 0, 1024], seq).splitlines()
    assert len(out) == 500
    assert all(float(line.split()[0]) == 1024.0 for line in out)
