#!/usr/bin/env bash
# One binary, 1 thread against 2, alternating (1,2 / 2,1 / ...): the 2-thread scaling of a training step
# (bench/RESULTS.md, 2026-12-06 16:41). Prints per run "ROUND THREADS median step S steps ... loss L cpu U S steal
# TICKS load X": the median of steps 3 to the last (step wall time from metrics.jsonl's elapsed_s), every step, the
# run's CPU seconds, the host's steal ticks (/proc/stat) during the run and the load after it.
# Usage: bench/threads_series.sh QTUNE [ROUNDS [PRESET [MODE [B [T [STEPS]]]]]]
#   default: 4 rounds of Qwen2.5-0.5B's shape, full fine-tuning, fp32, B 1 x T 256, 5 steps
set -euo pipefail
bin=$(realpath "$1") rounds=${2:-4} preset=${3:-qwen2.5-0.5b} mode=${4:-full} mb=${5:-1} seq=${6:-256} steps=${7:-5}
export QT_MB=$mb QT_SEQ=$seq QT_STEPS=$steps QT_MODE=$mode
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
cd "$w"
"$bin" init --out m --preset "$preset" --seed 1 >/dev/null 2>&1
python3 - <<'PY'
import json, os, random
mb, seq, steps = (int(os.environ[k]) for k in ("QT_MB", "QT_SEQ", "QT_STEPS"))
r = random.Random(1)
vocab = min(1000, json.load(open("m/config.json"))["vocab_size"])
with open("d.jsonl", "w") as f:
    for i in range(max(200, mb * steps)):
        f.write(json.dumps({"input_ids": [r.randrange(vocab) for _ in range(seq)]}) + "\n")
j = {"model": "m", "output_dir": "o",
     "data": {"train": "d.jsonl", "seq_len": seq, "packing": False, "shuffle": False},
     "train": {"max_steps": steps, "log_steps": 1, "seed": 1, "save_steps": 0, "overwrite_output_dir": True},
     "deepspeed": {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1}}
if os.environ["QT_MODE"] == "lora":
    j["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
json.dump(j, open("job.json", "w"))
PY
for r in $(seq "$rounds"); do
  order="1 2"; [ $((r % 2)) = 0 ] && order="2 1"
  for th in $order; do
    s0=$(head -1 /proc/stat)
    OMP_NUM_THREADS=$th OPENBLAS_NUM_THREADS=1 /usr/bin/time -f '%U %S' -o t.txt "$bin" train job.json >/dev/null 2>&1
    s1=$(head -1 /proc/stat)
    S0=$s0 S1=$s1 R=$r TH=$th python3 -c "
import json, os, statistics
l = [json.loads(x) for x in open('o/metrics.jsonl') if '\"loss\"' in x]
e = [l[0]['elapsed_s']] + [l[i]['elapsed_s'] - l[i - 1]['elapsed_s'] for i in range(1, len(l))]
d = [int(y) - int(x) for x, y in zip(os.environ['S0'].split()[1:], os.environ['S1'].split()[1:])]
print(os.environ['R'], os.environ['TH'], 'median step %.3f' % statistics.median(e[2:]), 'steps',
      ' '.join('%.2f' % x for x in e), 'loss', l[-1]['loss'], 'cpu', open('t.txt').read().strip(), 'steal', d[7],
      'load', open('/proc/loadavg').read().split()[0])"
  done
done
