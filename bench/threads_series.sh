#!/usr/bin/env bash
# One binary, 1 thread against 2, alternating (1,2 / 2,1 / ...): the 2-thread scaling of a training step
# (bench/RESULTS.md, 2026-12-06 16:41). Prints per run "ROUND THREADS median step S steps ... loss L cpu U S steal
# TICKS load X": the median of steps 3 to the last (step wall time from metrics.jsonl's elapsed_s), every step, the
# run's CPU seconds, the host's steal ticks (/proc/stat) during the run and the load after it.
# Usage: bench/threads_series.sh QTUNE [ROUNDS [PRESET [MODE [B [T [STEPS]]]]]]
#   default: 4 rounds of Qwen2.5-0.5B's shape, full fine-tuning, fp32, B 1 x T 256, 5 steps
set -euo pipefail
bin=$(realpath "$1") rounds=${2:-4} preset=${3:-qwen2.5-0.5b} mode=${4:-full} mb=${5:-1} seq=${6:-256} steps=${7:-5}
here=$(dirname "$(realpath "$0")")
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
cd "$w"
"$bin" init --out m --preset "$preset" --seed 1 >/dev/null 2>&1
python3 "$here/tiny_jobs.py" "$mb" "$seq" "$steps"
for r in $(seq "$rounds"); do
  order="1 2"; [ $((r % 2)) = 0 ] && order="2 1"
  for th in $order; do
    s0=$(head -1 /proc/stat)
    OMP_NUM_THREADS=$th OPENBLAS_NUM_THREADS=1 /usr/bin/time -f '%U %S' -o t.txt "$bin" train "$mode.json" >/dev/null 2>&1
    s1=$(head -1 /proc/stat)
    S0=$s0 S1=$s1 R=$r TH=$th MODE=$mode python3 -c "
import json, os, statistics
l = [json.loads(x) for x in open('o_' + os.environ['MODE'] + '/metrics.jsonl') if '\"loss\"' in x]
e = [l[0]['elapsed_s']] + [l[i]['elapsed_s'] - l[i - 1]['elapsed_s'] for i in range(1, len(l))]
d = [int(y) - int(x) for x, y in zip(os.environ['S0'].split()[1:], os.environ['S1'].split()[1:])]
print(os.environ['R'], os.environ['TH'], 'median step %.3f' % statistics.median(e[2:]), 'steps',
      ' '.join('%.2f' % x for x in e), 'loss', l[-1]['loss'], 'cpu', open('t.txt').read().strip(), 'steal', d[7],
      'load', open('/proc/loadavg').read().split()[0])"
  done
done
