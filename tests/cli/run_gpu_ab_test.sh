#!/usr/bin/env bash
# bench/run-gpu-ab on stand-ins for two gpu_bench binaries (no GPU needed): each prints the
# lines gpu_bench --point and --fused --point print (as bench/gpu_bench.cu prints them), with numbers that depend on the binary and
# on a per-call counter, so the medians, the B/A ratios and the alternation can be checked; and
# its refusals (a binary that prints no numbers, a bad ROUNDS, a missing binary).
set -uo pipefail
ab="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }
# stand-in NAME SCALE: a gpu_bench whose every time is SCALE times a base value, plus the
# call's number (1, 2, 3, ... per binary) so the median of three runs is the second run's.
stand_in() {
  cat >"$work/$1" <<STUB
#!/usr/bin/env bash
n=\$(( \$(cat "$work/$1.calls" 2>/dev/null || echo 0) + 1 ))
echo \$n >"$work/$1.calls"
echo "$1 \$*" >>"$work/order"
s=$2
v() { awk -v b="\$1" -v s=\$s -v n=\$n 'BEGIN {printf "%.1f", b * s + n}'; }
echo "point: dense mma.sync 756.4 us, wgmma \$(v 270) us (agrees, worst deviation 0.00045 of the row max), sparse stage on wgmma; spin \$(v 30) us (select 10.5), sparse \$(v 180) us per layer of a 61-layer step (probe period 0); BeginStep (with every layer's selection) 516.4 us per step; the EMA's bytes alone 15.9 us per layer"
if [ "\$1" = --fused ]; then
  echo "point, fused mode: fused sparse stage 198.6 us, SPIN \$(v 50) us per layer"
  echo "point, top-K remapped (us per layer): copies 1.7; unfused + Remap 189.5, + RemapTopK 193.5, RemapAndObserve \$(v 190) (SPIN 38.2, 42.2, 46.6); one call + Remap \$(v 200), + RemapTopK \$(v 210) (SPIN 54.8, 55.5); dense \$(v 280)"
  echo "point, table at BeginStep (us per layer, the three graphs timed together after the others): RemapAndObserve \$(v 192) -> with the table at BeginStep \$(v 188) -> and the EMA deferred \$(v 186) (SPIN 42.5 -> 39.2 -> 37.0; SPIN/dense 0.151 -> 0.139 -> 0.131; sparse stage/dense, the copies left out, 0.665 -> 0.657)"
fi
STUB
  chmod +x "$work/$1"
}
stand_in a 1
stand_in b 2
cat >"$work/silent" <<'STUB'
#!/usr/bin/env bash
echo "no CUDA device"
STUB
chmod +x "$work/silent"

# Default mode, one point, three rounds: A's calls are 1, 2, 3 (median 2), B's too.
out=$(bash "$ab" "$work/a" "$work/b" 3 64,131072,0.5,bf16 2>&1)
rc=$?
if [ $rc -eq 0 ] && grep -q '| 64,131072,0.5,bf16 | SPIN | 32.0 | 62.0 | 1.938 |' <<<"$out" &&
   grep -q '| 64,131072,0.5,bf16 | sparse stage | 182.0 | 362.0 | 1.989 |' <<<"$out" &&
   grep -q '| 64,131072,0.5,bf16 | dense | 272.0 | 542.0 | 1.993 |' <<<"$out"; then
  pass "medians and B/A of SPIN, the sparse stage and dense"
else
  fail "default mode (rc=$rc): $out"
fi
if [ "$(cut -d' ' -f1 "$work/order" | tr '\n' ' ')" = "a b a b a b " ]; then
  pass "the two binaries alternate"
else
  fail "order: $(tr '\n' ' ' <"$work/order")"
fi

# --fused: the paths of gpu_bench --fused --point (calls 4, 5, 6 now: median 5).
rm -f "$work/order"
out=$(bash "$ab" --fused "$work/a" "$work/b" 3 1,131072,0.5,bf16,0,2 2>&1)
rc=$?
want=("Select + Observe SPIN | 35.0 | 65.0" "fused two calls SPIN | 55.0 | 105.0"
      "RemapAndObserve | 195.0 | 385.0" "one call + Remap | 205.0 | 405.0"
      "one call + RemapTopK | 215.0 | 425.0" "pair: RemapAndObserve | 197.0 | 389.0"
      "pair: table at BeginStep | 193.0 | 381.0" "pair: EMA deferred | 191.0 | 377.0"
      "dense | 285.0 | 565.0")
missing=""
for w in "${want[@]}"; do
  grep -qF "| 1,131072,0.5,bf16,0,2 | $w |" <<<"$out" || missing="$missing [$w]"
done
if [ $rc -eq 0 ] && [ -z "$missing" ] && grep -q -- "--fused --point 1,131072,0.5,bf16,0,2" "$work/order"; then
  pass "--fused: every path's median, from gpu_bench --fused --point"
else
  fail "--fused (rc=$rc, missing$missing): $out"
fi

# Refusals.
out=$(bash "$ab" "$work/a" "$work/silent" 1 64,131072,0.5,bf16 2>&1)
rc=$?
if [ $rc -eq 1 ] && grep -q "printed 0 of the 3 numbers expected" <<<"$out"; then
  pass "a binary that prints no numbers is an error that names it"
else
  fail "silent binary (rc=$rc): $out"
fi
out=$(bash "$ab" "$work/a" "$work/b" x 2>&1)
rc=$?
if [ $rc -eq 2 ] && grep -q "ROUNDS must be a positive integer" <<<"$out"; then
  pass "a bad ROUNDS is refused"
else
  fail "bad rounds (rc=$rc): $out"
fi
out=$(bash "$ab" "$work/a" "$work/nonesuch" 2>&1)
rc=$?
if [ $rc -eq 2 ] && grep -q "nonesuch is not an executable gpu_bench" <<<"$out"; then
  pass "a missing binary is refused"
else
  fail "missing binary (rc=$rc): $out"
fi
out=$(bash "$ab" 2>&1)
rc=$?
if [ $rc -eq 2 ] && grep -q "Usage: bench/run-gpu-ab" <<<"$out"; then
  pass "no arguments print the usage"
else
  fail "usage (rc=$rc): $out"
fi
[ $fails -eq 0 ] || { echo "$fails failed"; exit 1; }
echo "all passed"
