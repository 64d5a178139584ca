#!/bin/bash
# python3 -m spind.replay equals spinctl replay byte for byte: dumps and --json summaries of
# bench/replay-dumps' 16 runs (4 traces: plain, 3-row MTP, block size 32, 1% non-finite scores;
# x 4 policies: uniform, bf16 without exploration, per-layer budgets with probes, probes with
# another alpha). Then one bad input: the same one-line error path.
#   replay_equal_test.sh SPINCTL PYTHON REPO   (PYTHONPATH holds the built package)
set -euo pipefail
spinctl=$1 python=$2 repo=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export TRACES=$dir/traces
bash "$repo/bench/replay-dumps" "$spinctl" "$dir/spinctl"
REPLAY="$python -m spind.replay" bash "$repo/bench/replay-dumps" "$spinctl" "$dir/python"
if ! diff -r "$dir/spinctl" "$dir/python" >"$dir/diff.txt"; then
  head -c 2000 "$dir/diff.txt" >&2
  echo "FAIL: python3 -m spind.replay differs from spinctl replay" >&2
  exit 1
fi
n=$(ls "$dir/python" | wc -l)
[ "$n" -eq 32 ] || { echo "FAIL: $n files, expected 32" >&2; exit 1; }
echo "ok: $n dumps and summaries identical"
# A float16 trace (scores.npy '<f2', as bench/traces/attn-h100-32k-hard keeps one): spinctl and
# python3 -m spind.replay widen it alike, and replay it exactly as its float32 copy.
mkdir -p "$dir/h16" "$dir/h32"
"$spinctl" gen-trace "$dir/g" --layers 3 --slots 4096 --steps 48 --seed 11 >/dev/null
"$python" - "$dir" <<'PY'
import shutil, sys
import numpy
d = sys.argv[1]
half = numpy.load(f"{d}/g/scores.npy").astype("<f2")
numpy.save(f"{d}/h16/scores.npy", half)
numpy.save(f"{d}/h32/scores.npy", half.astype("<f4"))
for t in ("h16", "h32"):
    shutil.copy(f"{d}/g/meta.json", f"{d}/{t}/meta.json")
PY
policy=(--sparsity 0.5 --probe-period 8 --budget per-layer --seed 4 --json --quiet)
"$spinctl" replay --trace "$dir/h16" "${policy[@]}" --dump "$dir/h16-s.jsonl" >"$dir/h16-s.json"
"$spinctl" replay --trace "$dir/h32" "${policy[@]}" --dump "$dir/h32-s.jsonl" >"$dir/h32-s.json"
"$python" -m spind.replay --trace "$dir/h16" "${policy[@]}" --dump "$dir/h16-p.jsonl" \
  >"$dir/h16-p.json"
for f in h32-s h16-p; do
  for x in json jsonl; do
    cmp -s "$dir/h16-s.$x" "$dir/$f.$x" || { echo "FAIL: float16 trace: $f.$x differs" >&2; exit 1; }
  done
done
echo "ok: a float16 trace replays as its float32 copy, in spinctl and in python"
# A trace that is not one: a precise error, exit 1, no dump written.
mkdir -p "$dir/bad"
echo '{"layers": 2}' >"$dir/bad/meta.json"
if "$python" -m spind.replay --trace "$dir/bad" --dump "$dir/bad.jsonl" 2>"$dir/err.txt"; then
  echo "FAIL: a bad trace was accepted" >&2
  exit 1
fi
grep -q "scores.npy: not a regular file" "$dir/err.txt" || { cat "$dir/err.txt" >&2; exit 1; }
[ ! -e "$dir/bad.jsonl" ] || { echo "FAIL: a dump was written for a bad trace" >&2; exit 1; }
echo "ok: bad trace refused: $(cat "$dir/err.txt")"
