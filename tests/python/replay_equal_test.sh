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
