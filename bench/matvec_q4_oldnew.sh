#!/bin/bash
# bench_matvec --dtype q4 (the 0.5B decode step's products in NF4) for the
# 4-bit matvec of an older commit against this tree's, alternating rounds at
# 1 and 2 threads, a STREAM triad (bench_gemm --triad) before and after each
# run; one JSON line a run (bench/RESULTS-bf16.md, "NF4 decode").
#   bench/matvec_q4_oldnew.sh [OLD_REV (fc4bcdc)] [BUILD (build)] [ROUNDS (3)]
# The old binary is this tree's bench_matvec.o linked with OLD_REV's
# op_matvec.c, compiled with the build's flags (its other objects are the
# build's).
set -euo pipefail
old_rev=${1:-fc4bcdc}
build=$(realpath "${2:-build}")
rounds=${3:-3}
src=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$src" show "$old_rev:src/backend/cpu/op_matvec.c" > "$tmp/op_matvec.c"
cc -O3 -DNDEBUG -march=native -fopenmp -std=gnu11 -I "$src/include" -I "$src/src" -I "$build/generated" \
   -c "$tmp/op_matvec.c" -o "$tmp/op_matvec.o"
link=$(sed -e "s| -o bench_matvec | $tmp/op_matvec.o -o $tmp/bench_matvec_old |" \
           "$build/bench/CMakeFiles/bench_matvec.dir/link.txt")
(cd "$build/bench" && eval "$link")
triad() { OMP_NUM_THREADS=$1 "$build/bench/bench_gemm" --triad --threads "$1" --reps 3 | head -1 |
          python3 -c "import json, sys; print(json.loads(sys.stdin.read())['gbs'])"; }
for r in $(seq "$rounds"); do
  for t in 1 2; do
    for b in old new; do
      bin=$build/bench/bench_matvec
      [ $b = old ] && bin=$tmp/bench_matvec_old
      g0=$(triad $t)
      o=$(OMP_NUM_THREADS=$t "$bin" --dtype q4 --threads $t --reps 8)
      g1=$(triad $t)
      echo "{\"round\": $r, \"bin\": \"$b\", \"triad\": [$g0, $g1], \"load\": $(cut -d' ' -f1 /proc/loadavg), \"run\": $o}"
    done
  done
done
