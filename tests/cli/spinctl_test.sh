#!/usr/bin/env bash
# spinctl as a user runs it: success paths print what the docs say; every bad input exits
# non-zero with one line that names the problem.
set -uo pipefail
spinctl="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }

# expect_error NAME PATTERN CMD...: non-zero exit, exactly one stderr line matching PATTERN.
expect_error() {
  local name="$1" pattern="$2"
  shift 2
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$work/err")
  if [ "$rc" -ne 0 ] && [ "$lines" -eq 1 ] && grep -qE "$pattern" "$work/err"; then
    pass "$name"
  else
    fail "$name (rc=$rc, stderr lines=$lines): $(head -c 300 "$work/err")"
  fi
}

# A small valid trace to break in different ways.
"$spinctl" gen-trace "$work/t" --layers 2 --slots 512 --steps 6 --topk 64 --prompt-len 300 \
  >"$work/gen.out" 2>&1 && grep -q "prev-iter pearson" "$work/gen.out" \
  && pass "gen-trace small" || fail "gen-trace small: $(cat "$work/gen.out")"

"$spinctl" replay --trace "$work/t" --json --quiet >"$work/json" 2>"$work/err"
if [ $? -eq 0 ] && grep -q '"mean_miss"' "$work/json" && grep -q '"p99_miss"' "$work/json" \
  && grep -q '"realized_sparsity"' "$work/json" && grep -q '"effective_sparsity"' "$work/json" \
  && grep -q '"per_layer":\[{' "$work/json" && [ "$(wc -l <"$work/json")" -eq 1 ]; then
  pass "replay --json"
else
  fail "replay --json: $(cat "$work/json" "$work/err")"
fi

"$spinctl" replay --trace "$work/t" --dump "$work/d.jsonl" --quiet >"$work/table" 2>&1
if [ "$(wc -l <"$work/d.jsonl")" -eq 12 ] && head -n 1 "$work/d.jsonl" \
  | grep -qE '^\{"step":0,"layer":0,"blocks":\[0,1,2,3,4\],"miss":0\}$' \
  && grep -q "^  all" "$work/table"; then
  pass "replay --dump and table"
else
  fail "replay --dump: $(head -n 2 "$work/d.jsonl") $(cat "$work/table")"
fi

"$spinctl" --help >"$work/help" 2>&1 && grep -q "replay" "$work/help" && pass "--help" \
  || fail "--help"
"$spinctl" replay --help >"$work/help" 2>&1 && grep -q -- "--probe-period" "$work/help" \
  && pass "replay --help" || fail "replay --help"

expect_error "missing trace dir" "$work/nope" "$spinctl" replay --trace "$work/nope"
expect_error "sparsity out of range" "sparsity 1.5 is out of range" \
  "$spinctl" replay --trace "$work/t" --sparsity 1.5
expect_error "alpha out of range" "alpha" "$spinctl" replay --trace "$work/t" --alpha 1
expect_error "--miss-measure exact without --miss-target" "needs --miss-target" \
  "$spinctl" replay --trace "$work/t" --probe-period 2 --miss-measure exact
expect_error "--miss-measure exact through spind" "offline diagnostic" \
  "$spinctl" --target 127.0.0.1:1 replay --trace "$work/t" --probe-period 2 --miss-target 0.02 \
  --miss-measure exact
expect_error "--miss-measure unknown" "not in \{estimate,exact\}" \
  "$spinctl" replay --trace "$work/t" --probe-period 2 --miss-target 0.02 --miss-measure perfect
expect_error "exploration out of range" "exploration" \
  "$spinctl" replay --trace "$work/t" --exploration -0.1
expect_error "unknown budget mode" "budget" "$spinctl" replay --trace "$work/t" --budget magic
expect_error "unknown state dtype" "state" "$spinctl" replay --trace "$work/t" --state fp8
expect_error "unwritable dump" "/nonexistent/x" \
  "$spinctl" replay --trace "$work/t" --dump /nonexistent/x --quiet

# Broken copies of the trace.
broken() {  # broken NAME: a fresh copy of the good trace at $work/NAME
  rm -rf "${work:?}/$1"
  cp -r "$work/t" "$work/$1"
}
broken trunc
truncate -s -100 "$work/trunc/scores.npy"
expect_error "truncated npy" "scores.npy.*(truncated|short|bytes)" \
  "$spinctl" replay --trace "$work/trunc"

broken dtype
off=$(grep -abo "<f4" "$work/dtype/scores.npy" | head -n 1 | cut -d: -f1)
printf '<f8' | dd of="$work/dtype/scores.npy" bs=1 seek="$off" conv=notrunc status=none
expect_error "wrong dtype" "<f8" "$spinctl" replay --trace "$work/dtype"

broken nometa
rm "$work/nometa/meta.json"
expect_error "missing meta.json" "meta.json" "$spinctl" replay --trace "$work/nometa"

broken badjson
printf '{"version":1, "layers":2,' >"$work/badjson/meta.json"
expect_error "malformed JSON" "meta.json" "$spinctl" replay --trace "$work/badjson"

meta='"version":1,"layers":2,"block_size":64,"topk":64,"steps":6,"rows":1'
broken ctx
printf '{%s,"q_pos":[299,300,301,302,303,304],"ctx_len":[300,301,302,303,304,9999]}' "$meta" \
  >"$work/ctx/meta.json"
expect_error "ctx_len beyond last axis" "ctx_len" "$spinctl" replay --trace "$work/ctx"

broken qpos
printf '{%s,"q_pos":[299,300,300,302,303,304],"ctx_len":[300,301,302,303,304,305]}' "$meta" \
  >"$work/qpos/meta.json"
expect_error "non-increasing q_pos" "q_pos" "$spinctl" replay --trace "$work/qpos"

broken shape
printf '{"version":1,"layers":3,"block_size":64,"topk":64,"steps":6,"rows":1,"q_pos":[299,300,301,302,303,304],"ctx_len":[300,301,302,303,304,305]}' \
  >"$work/shape/meta.json"
expect_error "shape mismatch" "shape" "$spinctl" replay --trace "$work/shape"

# Every command that reads a trace validates it the same way (LoadTrace): a trace that
# replay rejects is rejected by trace-stats with the same one line, never a crash, and a
# FIFO (or any non-regular file) in place of a trace file fails at once instead of hanging.
# Each run has a timeout, so a hang fails the test instead of stalling it.
# expect_same_error NAME PATTERN TRACE: trace-stats and replay fail with the same line.
expect_same_error() {
  local name="$1" pattern="$2" trace="$3"
  expect_error "trace-stats: $name" "$pattern" timeout 20 "$spinctl" trace-stats "$trace"
  cp "$work/err" "$work/err.stats"
  expect_error "replay: $name" "$pattern" timeout 20 "$spinctl" replay --trace "$trace" --quiet
  if cmp -s "$work/err" "$work/err.stats"; then
    pass "same error from trace-stats and replay: $name"
  else
    fail "different errors for $name: $(cat "$work/err.stats" "$work/err")"
  fi
}
# npy_header SHAPE: a version 1.0 float32 header for the Python tuple SHAPE (128 bytes).
npy_header() {
  local dict="{'descr': '<f4', 'fortran_order': False, 'shape': $1, }"
  printf '\x93NUMPY\x01\x00\x76\x00%s' "$dict"
  printf '%*s\n' $((117 - ${#dict})) ''
}
# geometry_trace NAME LAYERS BLOCK_SIZE: 6 steps x LAYERS layers x 1 row x 512 slots, scores
# all zero (a sparse file), so that only the geometry can be wrong.
geometry_trace() {
  rm -rf "${work:?}/$1"
  mkdir -p "$work/$1"
  npy_header "(6, $2, 1, 512)" >"$work/$1/scores.npy"
  truncate -s $((128 + 6 * $2 * 512 * 4)) "$work/$1/scores.npy"
  printf '{"version":1,"layers":%d,"block_size":%d,"topk":64,"steps":6,"rows":1,"q_pos":[299,300,301,302,303,304],"ctx_len":[300,301,302,303,304,305]}' \
    "$2" "$3" >"$work/$1/meta.json"
}
geometry_trace maxgeo 1024 4096
timeout 60 "$spinctl" trace-stats "$work/maxgeo" >"$work/out" 2>&1 \
  && grep -q "prev-iter pearson" "$work/out" && pass "trace-stats at the largest geometry" \
  || fail "trace-stats at the largest geometry: $(head -c 300 "$work/out")"
geometry_trace bigblock 2 4097
expect_same_error "block_size above 4096" \
  "bigblock/meta.json: 'block_size' is 4097; it must be at most 4096 .*fix meta.json" \
  "$work/bigblock"
geometry_trace hugeblock 2 2147483647
expect_same_error "block_size 2^31-1" "'block_size' is 2147483647; it must be at most 4096" \
  "$work/hugeblock"
geometry_trace manylayers 1025 64
expect_same_error "1025 layers" "manylayers/meta.json: 'layers' is 1025; it must be at most 1024" \
  "$work/manylayers"
# 2^31-1 layers with scores of that shape (2 steps x 2 slots, a 32 GiB sparse file): before
# the fix trace-stats tried to allocate per-layer state for all of them and aborted.
mkdir -p "$work/hugelayers"
npy_header "(2, 2147483647, 1, 2)" >"$work/hugelayers/scores.npy"
truncate -s $((128 + 2 * 2147483647 * 2 * 4)) "$work/hugelayers/scores.npy" 2>/dev/null \
  || truncate -s 128 "$work/hugelayers/scores.npy"  # no sparse files here: the shape is enough
printf '{"version":1,"layers":2147483647,"block_size":1,"topk":1,"steps":2,"rows":1,"q_pos":[0,1],"ctx_len":[1,2]}' \
  >"$work/hugelayers/meta.json"
expect_same_error "2^31-1 layers" "'layers' is 2147483647; it must be at most 1024" \
  "$work/hugelayers"
rm -rf "${work:?}/hugelayers"
broken manyrows
sed -i 's/"rows":1,/"rows":17,/' "$work/manyrows/meta.json"
expect_same_error "17 rows" "'rows' is 17; it must be at most 16" "$work/manyrows"
broken fifo
rm "$work/fifo/scores.npy"
mkfifo "$work/fifo/scores.npy"
expect_same_error "FIFO scores.npy" \
  "fifo/scores.npy is not a regular file \(it is a FIFO \(named pipe\)\).*regular file" \
  "$work/fifo"
broken fifometa
rm "$work/fifometa/meta.json"
mkfifo "$work/fifometa/meta.json"
expect_same_error "FIFO meta.json" "fifometa/meta.json is not a regular file \(it is a FIFO" \
  "$work/fifometa"
broken dirscores
rm "$work/dirscores/scores.npy"
mkdir "$work/dirscores/scores.npy"
expect_same_error "directory scores.npy" "scores.npy is not a regular file \(it is a directory\)" \
  "$work/dirscores"
broken devscores
ln -sf /dev/zero "$work/devscores/scores.npy"
expect_same_error "device scores.npy" "scores.npy is not a regular file \(it is a character device" \
  "$work/devscores"
expect_error "gen-trace beyond the layer limit" "'layers' is 1025; it must be at most 1024" \
  timeout 20 "$spinctl" gen-trace "$work/g1025" --layers 1025 --slots 512 --steps 6 --topk 64 \
  --prompt-len 300

# Non-finite scores are skipped and counted, never fatal.
"$spinctl" gen-trace "$work/nan" --layers 2 --slots 512 --steps 6 --topk 64 --prompt-len 300 \
  --nonfinite-rate 0.01 >/dev/null 2>&1
"$spinctl" replay --trace "$work/nan" --json --quiet >"$work/json" 2>&1
if grep -qE '"bad_scores":[1-9]' "$work/json" && ! grep -qi nan "$work/json"; then
  pass "non-finite scores counted"
else
  fail "non-finite scores: $(cat "$work/json")"
fi

# Per-layer budgets: the replay runs the controller in process and reports it.
"$spinctl" gen-trace "$work/pl" --layers 3 --slots 2048 --steps 24 --topk 128 --seed 60631 \
  >/dev/null 2>&1
"$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --sparsity 0.6 --json \
  --quiet >"$work/json" 2>"$work/err"
if [ $? -eq 0 ] && grep -q '"budget_mode":"per-layer"' "$work/json" \
  && grep -qE '"budget_recomputes":[1-9]' "$work/json" \
  && grep -q '"worst_layer_mean_miss"' "$work/json" && grep -q '"budget":' "$work/json"; then
  pass "replay --budget per-layer"
else
  fail "replay --budget per-layer: $(cat "$work/json" "$work/err")"
fi
"$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --quiet \
  >"$work/table" 2>&1 && grep -qE "^worst layer [0-9]+: mean miss .*per-layer budgets, [0-9]+ recomputes" \
  "$work/table" && pass "replay --budget per-layer table" \
  || fail "replay --budget per-layer table: $(cat "$work/table")"
expect_error "per-layer without probes" "error: --budget per-layer needs --probe-period > 0" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer
expect_error "per-layer probe period 0" "error: --budget per-layer needs --probe-period > 0" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 0
expect_error "budget smoothing 0" "budget smoothing 0 is out of range \(0, 1\]" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --budget-smoothing 0
expect_error "budget smoothing above 1" "budget smoothing 1.5 is out of range" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --budget-smoothing 1.5
expect_error "budget drift negative" "budget drift threshold -0.1 is out of range \[0, 1\]" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --budget-drift -0.1
expect_error "budget smoothing not a number" "budget-smoothing" \
  "$spinctl" replay --trace "$work/pl" --budget per-layer --probe-period 4 --budget-smoothing x
expect_error "budget mode typo" "budget" \
  "$spinctl" replay --trace "$work/pl" --budget perlayer --probe-period 4
expect_error "miss target 0" "miss-target 0 is out of range \(0, 1\)" \
  "$spinctl" replay --trace "$work/pl" --miss-target 0 --probe-period 4
expect_error "miss target 1" "miss-target 1 is out of range \(0, 1\)" \
  "$spinctl" replay --trace "$work/pl" --miss-target 1 --probe-period 4
expect_error "miss target negative" "miss-target -0.1 is out of range \(0, 1\)" \
  "$spinctl" replay --trace "$work/pl" --miss-target -0.1 --probe-period 4
expect_error "budget payback below 1" "budget payback steps 0.5 must be a finite value >= 1" \
  "$spinctl" replay --trace "$work/pl" --miss-target 0.02 --probe-period 4 --budget-payback 0.5
expect_error "budget credit above 1" "budget credit share 1.5 is out of range \[0, 1\]" \
  "$spinctl" replay --trace "$work/pl" --miss-target 0.02 --probe-period 4 --budget-credit 1.5
expect_error "budget band 1" "budget level band 1 is out of range \[0, 1\)" \
  "$spinctl" replay --trace "$work/pl" --miss-target 0.02 --probe-period 4 --budget-band 1

# eval: bad inputs are one line each.
expect_error "eval without --out" "error: --out is required" "$spinctl" eval
expect_error "eval sparsity out of range" "sparsity 1.2 is out of range \[0, 1\)" \
  "$spinctl" eval --out "$work/ev" --sparsities 0.3 1.2 --quiet
expect_error "eval probe period 0" "probe period > 0" \
  "$spinctl" eval --out "$work/ev" --probe-period 0 --quiet
expect_error "eval exploration out of range" "error: --exploration 1 is out of range" \
  "$spinctl" eval --out "$work/ev" --exploration 1 --quiet
expect_error "eval bad trace shape" "layers is 0" "$spinctl" eval --out "$work/ev" --layers 0 --quiet
expect_error "eval unwritable out" "/proc/nope" "$spinctl" eval --out /proc/nope --quiet
expect_error "eval miss target out of range" "miss-targets: 1 is out of range \(0, 1\)" \
  "$spinctl" eval --out "$work/ev" --miss-targets 0.02 1 --quiet
expect_error "eval --trace with a shape flag" "excludes" \
  "$spinctl" eval --out "$work/ev" --trace "$work/pl" --layers 4 --quiet
expect_error "eval --trace not a directory" "Directory does not exist" \
  "$spinctl" eval --out "$work/ev" --trace "$work/no-such-trace" --quiet
expect_error "eval --trace not a trace" "meta.json" \
  "$spinctl" eval --out "$work/ev" --trace "$work" --quiet
expect_error "eval --jobs 0" "jobs" "$spinctl" eval --out "$work/ev" --trace "$work/pl" --jobs 0
# eval on a given trace: the miss-target and p99-at-half tables.
if "$spinctl" eval --out "$work/ev-given" --trace "$work/pl" --sparsities 0.3 0.6 \
  --miss-targets 0.05 --quiet >"$work/md" 2>"$work/err" \
  && grep -q "^- \`$work/pl\`: " "$work/md" && grep -q "^| 0.050 | " "$work/md" \
  && grep -q '"miss_target_points"' "$work/ev-given/results.json" \
  && [ ! -d "$work/ev-given/traces" ]; then
  pass "eval --trace"
else
  fail "eval --trace: $(head -c 300 "$work/err") $(head -c 300 "$work/md")"
fi

# trace-cut: a window of steps and layers is a trace of its own that replays, and replays as a
# trace of those steps written directly would (the first window equals the source's first steps
# replayed alone: same selections from a cold start).
if "$spinctl" trace-cut "$work/t" "$work/cut" --first-step 2 --steps 3 --first-layer 1 \
  >"$work/out" 2>"$work/err" \
  && grep -q "^wrote $work/cut: steps 2-4 and layers 1-1 of $work/t (3 steps x 1 layers" \
    "$work/out" \
  && "$spinctl" replay --trace "$work/cut" --json --quiet >"$work/json" 2>>"$work/err" \
  && grep -q '"steps":3' "$work/json" && grep -q '"layers":1' "$work/json"; then
  pass "trace-cut"
else
  fail "trace-cut: $(cat "$work/out" "$work/err")"
fi
"$spinctl" trace-cut "$work/t" "$work/head" --steps 4 >/dev/null 2>&1
"$spinctl" replay --trace "$work/head" --dump "$work/head.jsonl" --quiet >/dev/null 2>&1
if [ -s "$work/head.jsonl" ] && head -n 8 "$work/d.jsonl" | cmp -s - "$work/head.jsonl"; then
  pass "trace-cut: the first steps replay as in the whole trace"
else
  fail "trace-cut: the first 4 steps replay differently alone"
fi
expect_error "trace-cut past the last step" "steps 4-7 run past the trace's last step, 5" \
  "$spinctl" trace-cut "$work/t" "$work/bad" --first-step 4 --steps 4
expect_error "trace-cut onto itself" "would replace the trace it reads" \
  "$spinctl" trace-cut "$work/t" "$work/t" --steps 2
[ ! -e "$work/bad" ] && pass "trace-cut: nothing written for a refused cut" \
  || fail "trace-cut wrote $work/bad"

echo "spinctl cli: $fails failed"
exit $((fails > 0))
