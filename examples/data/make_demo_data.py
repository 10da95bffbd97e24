#!/usr/bin/env python3
"""Writes the demo's chat data: short, consistent question/answer pairs
(capitals, animal sounds, opposites, colours), each fact asked in several
phrasings that all end with the key word ("Name the capital of France." ->
"Paris."): the answer is one recalled word, which a 2-layer random model
with a LoRA adapter learns in about a minute of CPU. The eval set holds out one phrasing of some facts, so every eval
answer is a fact the training set teaches in other words.

Standard library only, deterministic (fixed seed); run from anywhere:
    python3 examples/data/make_demo_data.py [--out DIR]
writes demo-train.jsonl and demo-eval.jsonl into DIR (default: this folder,
examples/data/)."""
import argparse
import json
import os
import random

SYSTEM = "You are a concise assistant."

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Russia", "Moscow"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Australia", "Canberra"), ("Cuba", "Havana"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
]
CAPITAL_Q = ["What is the capital of {}?", "Which city is the capital of {}?",
             "Name the capital of {}.", "Tell me the capital of {}."]

SOUNDS = [
    ("dog", "woof"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"),
    ("pig", "oink"), ("lion", "roar"), ("owl", "hoot"), ("horse", "neigh"), ("frog", "ribbit"),
    ("mouse", "squeak"), ("snake", "hiss"), ("bee", "buzz"), ("crow", "caw"),
]
SOUND_Q = ["What is the sound of a {}?", "Which sound is made by a {}?", "Name the sound of a {}."]

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
    ("happy", "sad"), ("light", "dark"), ("open", "closed"), ("early", "late"), ("full", "empty"),
    ("hard", "soft"), ("old", "new"), ("rich", "poor"), ("wet", "dry"), ("loud", "quiet"),
    ("left", "right"), ("strong", "weak"), ("thick", "thin"), ("high", "low"), ("win", "lose"),
]
OPPOSITE_Q = ["What is the opposite of {}?", "Give the opposite of {}.", "Name the opposite of {}."]

COLOURS = [
    ("banana", "yellow"), ("lemon", "yellow"), ("strawberry", "red"), ("tomato", "red"),
    ("carrot", "orange"), ("orange", "orange"), ("lime", "green"), ("cucumber", "green"),
    ("blueberry", "blue"), ("plum", "purple"), ("coconut", "brown"), ("snowball", "white"),
    ("crow", "black"), ("flamingo", "pink"), ("frog", "green"), ("pumpkin", "orange"),
]
COLOUR_Q = ["What is the color of a {}?", "Which colour has a {}?", "Name the color of a {}."]


def facts():
    """(phrasings, answer) per fact."""
    out = []
    for c, cap in CAPITALS:
        out.append(([q.format(c) for q in CAPITAL_Q], f"{cap}."))
    for a, s in SOUNDS:
        out.append(([q.format(a) for q in SOUND_Q], f"{s.capitalize()}."))
    for w, o in OPPOSITES:
        out.append(([q.format(w) for q in OPPOSITE_Q], f"{o.capitalize()}."))
    for t, col in COLOURS:
        out.append(([q.format(t) for q in COLOUR_Q], f"{col.capitalize()}."))
    return out


def example(question, answer):
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output folder")
    out = ap.parse_args().out
    rng = random.Random(20240611)
    train, held = [], []
    for phrasings, answer in facts():
        # One fact in three gives one phrasing to the eval set; the others
        # stay in training, so the eval answer is known, the wording is new.
        hold = rng.randrange(len(phrasings)) if rng.random() < 1 / 3 else -1
        for i, q in enumerate(phrasings):
            (held if i == hold else train).append(example(q, answer))
    rng.shuffle(train)
    rng.shuffle(held)
    for name, rows in (("demo-train.jsonl", train), ("demo-eval.jsonl", held)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(train)} training and {len(held)} eval examples to {out}")


if __name__ == "__main__":
    main()
