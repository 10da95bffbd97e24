#!/usr/bin/env bash
# Figures for docs/distributed.md: per-rank optimizer-state bytes and peak RSS
# for N = 1, 2, 4 at ZeRO stages 0 and 2, and time per step with the
# communication share for N = 2 at stage 2, on the toy trainer (dist_driver).
# Usage: tests/dist/measure_figures.sh BUILD_DIR [HIDDEN]   (HIDDEN 500000: n = 10.5M fp32)
set -euo pipefail
build=${1:?build dir}
hidden=${2:-500000}
drv=$build/tests/dist/dist_driver
mpi=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
printf '%-5s %-2s %-5s %-4s %14s %14s %10s %10s\n' stage N accum rank opt_bytes peak_rss_MiB step_s comm_s
for stage in 0 2; do
  for n in 1 2 4; do
    accum=$((4 / n))
    "${mpi[@]}" -np $n "$drv" --hidden "$hidden" --micro 2 --accum $accum --steps 6 --stage $stage \
      --bucket 1048576 | grep '^{' | /usr/bin/python3 -c '
import json, sys
rows = sorted((json.loads(l) for l in sys.stdin), key=lambda r: r["rank"])
for r in rows:
    print("%-5d %-2d %-5s %-4d %14d %14.1f %10.4f %10.4f" % (r["stage"], r["world"], sys.argv[1], r["rank"],
          r["opt_bytes_device"] + r["opt_bytes_host"], r["peak_rss_bytes"] / 2**20, r["step_s"], r["comm_s"]))
' $accum
  done
done
