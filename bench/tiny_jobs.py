"""The jobs bench/oldnew_tiny.sh and bench/threads_series.sh run, written into the current folder beside the model
folder m/: d.jsonl (pre-tokenized rows of random ids below min(1000, vocab_size), seed 1) and lora.json / full.json
(fp32 unless PREC=bf16; LoRA r 8, alpha 16, no dropout, q_proj and v_proj; output o_lora / o_full; no shuffle, no
packing, no checkpoints, a metrics line every step).
Usage: python3 bench/tiny_jobs.py MICRO_BATCH SEQ_LEN STEPS [PREC]"""
import json
import random
import sys

mb, seq, steps = (int(x) for x in sys.argv[1:4])
prec = sys.argv[4] if len(sys.argv) > 4 else "fp32"
r = random.Random(1)
vocab = min(1000, json.load(open("m/config.json"))["vocab_size"])  # the tiny preset's vocabulary is 512
with open("d.jsonl", "w") as f:
    for i in range(max(200, mb * steps)):
        f.write(json.dumps({"input_ids": [r.randrange(vocab) for _ in range(seq)]}) + "\n")
for mode in ("lora", "full"):
    j = {"model": "m", "output_dir": "o_" + mode,
         "data": {"train": "d.jsonl", "seq_len": seq, "packing": False, "shuffle": False},
         "train": {"max_steps": steps, "log_steps": 1, "seed": 1, "save_steps": 0, "overwrite_output_dir": True},
         "deepspeed": {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1}}
    if prec == "bf16":
        j["deepspeed"]["bf16"] = {"enabled": True}
    if mode == "lora":
        j["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    json.dump(j, open(mode + ".json", "w"))
