"""The data loader against independent Python references: HF's label
semantics (labels unshifted, -100 ignored, shift by one inside an example),
greedy packing with positions/doc_start, sharding over 3 ranks, split of
overlong examples, resume from a saved position, and the documented token
cache layout. Drives build/tests/unit/data/dl_dump (prints batches as JSON)."""
import json
import os
import random
import struct
import subprocess

import pytest

BUILD = os.environ.get("QTUNE_BUILD_DIR", "")
DUMP = os.path.join(BUILD, "tests", "unit", "data", "dl_dump")
IGNORE = -100

pytestmark = pytest.mark.skipif(not os.path.exists(DUMP), reason="dl_dump not built (cmake --build ... --target dl_dump)")


def run_dump(*args):
    out = subprocess.run([DUMP, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    return lines[:-1], lines[-1]["stats"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def random_examples(n, seed, max_len=9, labels=True):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(1, max_len)
        ids = [1000 * (i + 1) + j for j in range(k)]  # first token names the example
        row = {"input_ids": ids}
        if labels and rng.random() < 0.7:
            row["labels"] = [t if rng.random() < 0.6 else IGNORE for t in ids]
        rows.append(row)
    return rows


def hf_targets(row):
    """HF causal-LM loss pairs: logits[t] is scored against labels[t+1]."""
    labels = row.get("labels") or row["input_ids"]
    return labels[1:] + [IGNORE]


def rows_of(batch, T):
    B = len(batch["inputs"]) // T
    return [{k: batch[k][r * T:(r + 1) * T] for k in ("inputs", "targets", "positions", "doc_start")} for r in range(B)]


def test_padding_mode_matches_hf_label_shift(tmp_path):
    rows = random_examples(40, seed=1)
    write_jsonl(tmp_path / "d.jsonl", rows)
    T = 10
    batches, stats = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", T, "--batch", 3, "--packing", 0,
                              "--eval", "--no-cache")
    assert stats["n_examples"] == 40
    got = [r for b in batches for r in rows_of(b, T)]
    assert len(got) == 42  # 14 batches of 3 rows; the last two rows are empty padding
    for row, g in zip(rows, got):
        n = len(row["input_ids"])
        assert g["inputs"][:n] == row["input_ids"]
        assert g["targets"] == hf_targets(row) + [IGNORE] * (T - n)
        assert g["positions"][:n] == list(range(n))
        assert g["doc_start"][:n] == [0] * n
    for g in got[40:]:
        assert all(t == IGNORE for t in g["targets"])
    assert sum(b["n_target"] for b in batches) == sum(sum(t != IGNORE for t in hf_targets(r)) for r in rows)


def greedy_rows(rows, T):
    """Greedy packing in order: fill a row while the next example fits."""
    out, row = [], []
    for r in rows:
        n = len(r["input_ids"])
        if row and sum(len(x["input_ids"]) for x in row) + n > T:
            out.append(row)
            row = []
        row.append(r)
    if row:
        out.append(row)
    return out


def best_fit_rows(rows, T, W):
    """Best-fit decreasing in windows of W examples: longest first (ties in
    order), each into the open row with the least room that fits it (ties:
    the oldest row); rows in the order they were opened."""
    out = []
    for a in range(0, len(rows), W):
        window = sorted(range(a, min(a + W, len(rows))), key=lambda i: (-len(rows[i]["input_ids"]), i))
        bins, room = [], []
        for i in window:
            n = len(rows[i]["input_ids"])
            fits = [b for b in range(len(bins)) if room[b] >= n]
            if fits:
                b = min(fits, key=lambda b: (room[b], b))
            else:
                bins.append([])
                room.append(T)
                b = len(bins) - 1
            bins[b].append(rows[i])
            room[b] -= n
        out += bins
    return out


def check_packed(batches, ref_rows, T, B):
    got = [r for b in batches for r in rows_of(b, T)]
    ref = ref_rows + [[]] * (-len(ref_rows) % B)
    assert len(got) == len(ref)
    for packed, g in zip(ref, got):
        inputs, targets, positions, doc_start = [], [], [], []
        for r in packed:
            n, c = len(r["input_ids"]), len(inputs)
            inputs += r["input_ids"]
            targets += hf_targets(r)
            positions += list(range(n))
            doc_start += [c] * n
        c = len(inputs)
        assert c <= T
        assert g["inputs"][:c] == inputs
        assert g["targets"] == targets + [IGNORE] * (T - c)
        assert g["positions"] == positions + list(range(T - c))
        assert g["doc_start"] == doc_start + [c] * (T - c)
        # attention stays inside each example: doc_start <= t, positions count from it
        for t in range(T):
            assert g["doc_start"][t] <= t
            assert g["positions"][t] == t - g["doc_start"][t]
    return sum(len(r) for r in got) * T, sum(T - len(sum((x["input_ids"] for x in p), [])) for p in ref)


def test_packing_greedy_matches_reference(tmp_path):
    rows = random_examples(60, seed=2)
    write_jsonl(tmp_path / "d.jsonl", rows)
    T, B = 16, 2
    batches, _ = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", T, "--batch", B, "--eval", "--no-cache",
                          "--workers", 3, "--prefetch", 4, "--pack-window", 1)
    check_packed(batches, greedy_rows(rows, T), T, B)


def test_packing_best_fit_matches_reference(tmp_path):
    rows = random_examples(150, seed=6, max_len=15)
    write_jsonl(tmp_path / "d.jsonl", rows)
    T, B, W = 16, 2, 40
    batches, _ = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", T, "--batch", B, "--eval", "--no-cache",
                          "--pack-window", W)
    ref = best_fit_rows(rows, T, W)
    check_packed(batches, ref, T, B)
    assert len(ref) < len(greedy_rows(rows, T))  # fuller rows than greedy


def test_three_ranks_cover_each_example_once_per_epoch(tmp_path):
    rows = random_examples(31, seed=3, labels=False)
    write_jsonl(tmp_path / "d.jsonl", rows)
    for epoch in (0, 1):
        seen = []
        for rank in range(3):
            batches, stats = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", 12, "--batch", 1, "--packing", 0,
                                      "--shuffle", 1, "--seed", 9, "--rank", rank, "--world", 3, "--no-cache",
                                      "--state", f"{epoch},0", "--batches", 31 // 3 + (rank < 31 % 3))
            assert stats["n_examples_rank"] == 31 // 3 + (rank < 31 % 3)
            seen += [b["inputs"][0] // 1000 for b in batches]
            assert batches[-1]["state"] == [epoch + 1, 0]
        assert sorted(seen) == list(range(1, 32))


def test_split_overlong_predicts_every_label_once(tmp_path):
    ids = list(range(100, 137))  # 37 tokens
    labels = [t if t % 3 else IGNORE for t in ids]
    write_jsonl(tmp_path / "d.jsonl", [{"input_ids": ids, "labels": labels}])
    T = 8
    batches, stats = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", T, "--batch", 1, "--packing", 0,
                              "--eval", "--split", "--no-cache")
    assert stats["n_split"] == 1
    pairs = []
    for b in batches:
        for t in range(T):
            if b["targets"][t] != IGNORE:
                pairs.append((b["inputs"][t], b["targets"][t]))
    want = [(ids[t], labels[t + 1]) for t in range(len(ids) - 1) if labels[t + 1] != IGNORE]
    assert pairs == want


def test_resume_from_state_reproduces_stream(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", random_examples(25, seed=4))
    common = ["--data", tmp_path / "d.jsonl", "--seq-len", 16, "--batch", 2, "--shuffle", 1, "--seed", 3,
              "--no-cache", "--workers", 2]
    full, _ = run_dump(*common, "--batches", 20)
    cut = 7
    e, i = full[cut - 1]["state"]
    rest, _ = run_dump(*common, "--batches", 20 - cut, "--state", f"{e},{i}")
    assert [b["inputs"] for b in rest] == [b["inputs"] for b in full[cut:]]
    assert [b["targets"] for b in rest] == [b["targets"] for b in full[cut:]]
    assert full[-1]["state"][0] >= 1  # the stream crossed an epoch boundary


def test_cache_layout_as_documented(tmp_path):
    rows = random_examples(12, seed=5)
    write_jsonl(tmp_path / "d.jsonl", rows)
    cache = tmp_path / "cache"
    _, stats = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", 64, "--eval", "--cache-dir", cache)
    assert stats["n_cache_written"] == 1 and stats["n_cache_hits"] == 0
    _, stats = run_dump("--data", tmp_path / "d.jsonl", "--seq-len", 32, "--eval", "--cache-dir", cache)
    assert stats["n_cache_hits"] == 1  # seq_len is not part of the key
    (f,) = list(cache.glob("*.qtc"))  # beside it: the builders' lock file
    assert f.name.startswith("d.jsonl.") and f.name.endswith(".qtc")
    data = f.read_bytes()
    assert data[:8] == b"QTDCACHE"
    version, hbytes = struct.unpack_from("<II", data, 8)
    assert (version, hbytes) == (1, 120)
    src_size, = struct.unpack_from("<Q", data, 32)
    assert src_size == os.path.getsize(tmp_path / "d.jsonl")
    fmt_req, fmt_read, mask_prompt = struct.unpack_from("<III", data, 48)
    assert (fmt_req, fmt_read, mask_prompt) == (0, 4, 1)
    E, N, skipped = struct.unpack_from("<QQQ", data, 80)
    assert E == len(rows) and skipped == 0
    assert N == sum(len(r["input_ids"]) for r in rows)
    assert len(data) == 120 + 8 * (E + 1) + 4 * N + N
    offsets = struct.unpack_from(f"<{E + 1}Q", data, 120)
    ids = struct.unpack_from(f"<{N}i", data, 120 + 8 * (E + 1))
    mask = data[120 + 8 * (E + 1) + 4 * N:]
    for k, r in enumerate(rows):
        a, b = offsets[k], offsets[k + 1]
        assert list(ids[a:b]) == r["input_ids"]
        labels = r.get("labels") or r["input_ids"]
        assert list(mask[a:b]) == [int(l != IGNORE) for l in labels]


def test_malformed_line_message_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, 99999]}\n')
    out = subprocess.run([DUMP, "--data", p, "--vocab", "1000", "--no-cache"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"{p}:2:" in out.stderr and "out of range" in out.stderr
    out = subprocess.run([DUMP, "--data", p, "--vocab", "1000", "--no-cache", "--skip-bad-lines", "--eval"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["stats"]["n_lines_skipped"] == 1


def test_line_over_default_cap_is_refused_without_holding_it(tmp_path):
    """A 160 MB line (over the 64 MiB default cap) is reported as file:line and
    never held whole: the process stays far below the line's size."""
    import resource
    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"input_ids": [1, 2]}\n{"input_ids": [')
        chunk = b"7," * (1 << 20)
        for _ in range(80):  # 80 x 2 MiB
            f.write(chunk)
        f.write(b'7]}\n')
    out = subprocess.run([DUMP, "--data", str(p), "--no-cache"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"{p}:2:" in out.stderr and "more than the limit of 67108864" in out.stderr
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < 110 * 1024, peak_kib
    p.unlink()
