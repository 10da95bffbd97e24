#!/usr/bin/env python3
"""Writes the demo's data: "Reverse: red cat sun =" -> " sun cat red", three
different words out of 20 (each one Qwen token with its leading space), in
TRL's prompt/completion format. 6,840 ordered triples; 20 are held out for
the eval set and never trained on, 3,000 others are the training set. Every
held-out word is seen in every position in training, but the triple is new:
the model can answer it only by having learned the rule (reverse), not a
table.

For the demo's DPO stage, preference pairs in TRL's format (prompt, chosen,
rejected): the reversed words chosen, another order of the same words
rejected; 1,000 pairs from the training triples (demo-pref-train.jsonl) and
200 held-out pairs (demo-pref-eval.jsonl): the 20 held-out triples and 180
triples that no stage trains on, so that the held-out accuracy moves in steps
of 0.005, not 0.05.

Standard library only, deterministic (fixed seed); run from anywhere:
    python3 examples/data/make_demo_data.py [--out DIR]
writes demo-train.jsonl, demo-eval.jsonl, demo-pref-train.jsonl and
demo-pref-eval.jsonl into DIR (default: this folder,
examples/data/)."""
import argparse
import json
import os
import random

WORDS = ("red cat sun dog tree fish bird king moon star blue green gold milk rain snow wind fire stone apple").split()
N_HELD, N_TRAIN, N_PREF, N_PREF_HELD = 20, 3000, 1000, 200


def row(t):
    return {"prompt": "Reverse: " + " ".join(t) + " =", "completion": " " + " ".join(reversed(t))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output folder")
    out = ap.parse_args().out
    rng = random.Random(1)
    triples = [(a, b, c) for a in WORDS for b in WORDS for c in WORDS if len({a, b, c}) == 3]
    rng.shuffle(triples)
    held, train = triples[:N_HELD], triples[N_HELD:N_HELD + N_TRAIN]
    unused = triples[N_HELD + N_TRAIN:]  # in no training set: held out for the DPO stage too
    for name, rows in (("demo-train.jsonl", train), ("demo-eval.jsonl", held)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for t in rows:
                f.write(json.dumps(row(t)) + "\n")
    prng = random.Random(2)  # its own stream: the SFT files above stay as they were
    pref_held = held + unused[:N_PREF_HELD - N_HELD]
    for name, rows in (("demo-pref-train.jsonl", train[:N_PREF]), ("demo-pref-eval.jsonl", pref_held)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for t in rows:
                wrong = [o for o in ((t[0], t[1], t[2]), (t[0], t[2], t[1]), (t[1], t[0], t[2]),
                                     (t[1], t[2], t[0]), (t[2], t[0], t[1])) if o != tuple(reversed(t))]
                r = row(t)
                f.write(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                    "rejected": " " + " ".join(prng.choice(wrong))}) + "\n")
    print(f"wrote {len(train)} training and {len(held)} held-out examples, {N_PREF} and {len(pref_held)} preference "
          f"pairs to {out}")


if __name__ == "__main__":
    main()
