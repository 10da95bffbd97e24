#!/usr/bin/env bash
# Old binary against new by instructions executed, not seconds: the same training job under valgrind's
# callgrind (its total Ir count), LoRA r 8 (q_proj, v_proj) and full fine-tuning, fp32, 1 thread.
# Instruction counts do not depend on the machine's load, so a refactor that should leave the hot path
# alone can be held to "same work" on a shared machine where seconds move by +-20% between rounds.
# (valgrind hides AVX-512 from the program, so OpenBLAS / oneDNN take their AVX2 paths under it: the same
# for both binaries.)
# (GOMP_SPINCOUNT is set as qtune would set it, so it does not execute itself again under valgrind.)
# Each binary runs the job twice, for STEPS steps and for 1: the difference is the instructions of steps
# 2..STEPS alone (loading, setup and the first step's one-time work cancel out).
# Usage: bench/oldnew_instructions.sh OLD_QTUNE NEW_QTUNE [PRESET|CONFIG.json [B [T [STEPS]]]]
#   (bench/oldnew_small.json: bench-tiny with a 4096-token vocabulary, so the layers, not the lm_head, dominate)
# Prints "MODE old|new IR(STEPS) IR(1) DIFFERENCE" and the new/old ratios of the whole runs and of the steps.
set -euo pipefail
old=$1 new=$2 preset=${3:-tiny} mb=${4:-2} seq=${5:-64} steps=${6:-3}
export QT_MB=$mb QT_SEQ=$seq QT_STEPS=$steps
if [ -f "$preset" ]; then preset=$(realpath "$preset"); fi
w=$(mktemp -d)
cd "$w"
if [ -f "$preset" ]; then how=(--config "$preset"); else how=(--preset "$preset"); fi
"$old" init --out m "${how[@]}" --seed 1 >/dev/null 2>&1
python3 - <<'PY'
import json, os, random
mb, seq, steps = (int(os.environ[k]) for k in ("QT_MB", "QT_SEQ", "QT_STEPS"))
r = random.Random(1)
with open("d.jsonl", "w") as f:
    for i in range(64):
        f.write(json.dumps({"input_ids": [r.randrange(500) for _ in range(seq)]}) + "\n")
for mode, n in [(m, n) for m in ("lora", "full") for n in (steps, 1)]:
    j = {"model": "m", "output_dir": "o_" + mode,
         "data": {"train": "d.jsonl", "seq_len": seq, "packing": False, "shuffle": False},
         "train": {"max_steps": n, "log_steps": 1, "seed": 1, "save_steps": 0, "overwrite_output_dir": True},
         "deepspeed": {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1}}
    if mode == "lora":
        j["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    json.dump(j, open(f"{mode}{n}.json", "w"))
PY
ir() {  # BINARY JOB: callgrind's total instruction count of `qtune train JOB`
  GOMP_SPINCOUNT=3000 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=cg.out \
    "$1" train "$2" >/dev/null 2>vg.err || { tail -5 vg.err >&2; exit 1; }
  sed -n 's/^summary: //p' cg.out
}
for mode in lora full; do
  declare -A all=() diff=()
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    a=$(ir "$bin" "$mode$steps.json"); b=$(ir "$bin" "${mode}1.json")
    all[$which]=$a diff[$which]=$((a - b))
    echo "$mode $which $a $b ${diff[$which]}"
  done
  python3 -c "print('$mode new/old: whole runs', round(${all[new]} / ${all[old]}, 5), ' steps 2..$steps', round(${diff[new]} / ${diff[old]}, 5))"
done
rm -rf "$w"
