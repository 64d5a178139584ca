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

echo "spinctl cli: $fails failed"
exit $((fails > 0))
