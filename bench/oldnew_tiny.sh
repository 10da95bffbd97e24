#!/usr/bin/env bash
# Old binary against new, alternating rounds (bench/RESULTS.md, 2026-12-06): LoRA r 8 (q_proj, v_proj) and full
# fine-tuning, fp32, bench-tiny, B 4 x T 128, 8 steps, 1 thread by default; prints
# "ROUND MODE old|new TOKENS_PER_S loss LAST_LOSS load LOAD1 cpu_s CPU_S" (the median tokens/s of steps 3 to the
# last in metrics.jsonl, the last step's loss, the 1-minute load average after the run, the run's CPU seconds
# (user + system, load and all steps: on a busy machine a steadier measure of the work than the wall clock)).
# Usage: bench/oldnew_tiny.sh OLD_QTUNE NEW_QTUNE [ROUNDS [PRESET [B [T [STEPS]]]]]
#   e.g. the 0.5B shape: bench/oldnew_tiny.sh old/qtune new/qtune 3 qwen2.5-0.5b 1 128 5
#   the tiny preset (vocabulary 512, token ids drawn below it): bench/oldnew_tiny.sh old/qtune new/qtune 3 tiny 4 256 40
# Environment: PREC=bf16 (deepspeed "bf16": {"enabled": true}; default fp32), MODES="lora" (default "lora full"),
# THREADS=2 (default 1), PRESET (the default of the PRESET argument, bench-tiny).
set -euo pipefail
old=$1 new=$2 rounds=${3:-4} preset=${4:-${PRESET:-bench-tiny}} mb=${5:-4} seq=${6:-128} steps=${7:-8}
prec=${PREC:-fp32} modes=${MODES:-lora full} threads=${THREADS:-1}
here=$(dirname "$(realpath "$0")")
w=$(mktemp -d)
cd "$w"
"$old" init --out m --preset "$preset" --seed 1 >/dev/null
python3 "$here/tiny_jobs.py" "$mb" "$seq" "$steps" "$prec"
for r in $(seq "$rounds"); do for mode in $modes; do for which in old new; do
  bin=$old; [ "$which" = new ] && bin=$new
  OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=1 /usr/bin/time -f '%U %S' -o cpu.txt "$bin" train "$mode.json" \
    >/dev/null 2>&1
  echo "$r $mode $which $(python3 -c "
import json, statistics
l = [json.loads(x) for x in open('o_$mode/metrics.jsonl') if '\"loss\"' in x]
print(statistics.median(m['tokens_per_s'] for m in l[2:]), 'loss', l[-1]['loss'], 'load', open('/proc/loadavg').read().split()[0],
      'cpu_s', round(sum(map(float, open('cpu.txt').read().split()[-2:])), 2))")"
done; done; done
rm -rf "$w"
