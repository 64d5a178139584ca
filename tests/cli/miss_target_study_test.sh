#!/usr/bin/env bash
# bench/miss-target-study on a small generated trace: one row per M, the kept JSON summaries,
# SPIN_STUDY_ARGS (the miss-target runs only), SEEDS, a failing replay, and the refusal of a
# directory that is not a trace. Usage: miss_target_study_test.sh SPINCTL SOURCE_DIR
set -uo pipefail
spinctl="$1"
study="$2/bench/miss-target-study"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }
export SPIN_JOBS=2
"$spinctl" gen-trace "$work/tiny" --layers 2 --slots 8192 --steps 48 --seed 5 >/dev/null ||
  { echo "FAIL gen-trace"; exit 1; }
rows() { grep -c "^| t0-tiny" "$1"; }

# Without SPIN_STUDY_ARGS (every miss-target job line must stay one replay).
if SPIN_STUDY_JSON="$work/j" bash "$study" "$spinctl" "$work/est.md" "$work/tiny" 2>"$work/err"; then
  pass "study runs without SPIN_STUDY_ARGS"
else
  fail "study without SPIN_STUDY_ARGS: $(tail -n 2 "$work/err")"
fi
[ "$(rows "$work/est.md" 2>/dev/null)" = 4 ] && pass "one row per M" || fail "rows: $(rows "$work/est.md")"
grep -q "^Runs whose worst layer is above 1.1 M: [0-4] of 4\.$" "$work/est.md" &&
  pass "the over-1.1 M count" || fail "no over-1.1 M count line"
n=$(ls "$work/j" 2>/dev/null | wc -l)
[ "$n" = 22 ] && pass "SPIN_STUDY_JSON keeps 4 + 18 summaries" || fail "kept $n summaries"
python3 - "$work/j" <<'PY' && pass "kept summaries are the replays' JSON" || fail "kept summaries"
import json, os, sys
d = sys.argv[1]
mt = json.load(open(os.path.join(d, "t0-tiny.mt-0.02.json")))
pl = json.load(open(os.path.join(d, "t0-tiny.pl-0.50.json")))
assert mt["budget_mode"] == "miss-target", mt["budget_mode"]
assert pl["budget_mode"] == "per-layer", pl["budget_mode"]
assert mt["steps"] == 48 and mt["layers"] == 2
PY

# SPIN_STUDY_ARGS: the miss-target runs change, the fixed targets do not.
if SPIN_STUDY_ARGS="--miss-measure exact" bash "$study" "$spinctl" "$work/exact.md" "$work/tiny" \
  2>"$work/err"; then
  pass "study runs with SPIN_STUDY_ARGS"
else
  fail "study with SPIN_STUDY_ARGS: $(tail -n 2 "$work/err")"
fi
grep -q -- "--probe-period 8 --miss-measure exact\`" "$work/exact.md" &&
  pass "the header names the extra arguments" || fail "header without the extra arguments"
fixed() { grep "^| t0-tiny" "$1" | cut -d'|' -f8-10; }
mtcols() { grep "^| t0-tiny" "$1" | cut -d'|' -f4-7; }
[ -n "$(fixed "$work/est.md")" ] && [ "$(fixed "$work/est.md")" = "$(fixed "$work/exact.md")" ] &&
  pass "fixed targets unchanged" || fail "fixed targets changed"
[ "$(mtcols "$work/est.md")" != "$(mtcols "$work/exact.md")" ] &&
  pass "miss-target runs took the arguments" || fail "miss-target runs identical"

# SEEDS: each trace once per seed.
SEEDS="1 2" bash "$study" "$spinctl" "$work/seeds.md" "$work/tiny" 2>"$work/err"
s1=$(grep -c "^| t0-tiny-s1 " "$work/seeds.md" 2>/dev/null)
s2=$(grep -c "^| t0-tiny-s2 " "$work/seeds.md" 2>/dev/null)
[ "$s1" = 4 ] && [ "$s2" = 4 ] && pass "SEEDS gives rows per seed" || fail "SEEDS rows: $s1 $s2"

# A replay that fails (here a bad SPIN_STUDY_ARGS) names itself and stops the study.
SPIN_STUDY_ARGS="--miss-measure bogus" bash "$study" "$spinctl" "$work/bad.md" "$work/tiny" \
  >/dev/null 2>"$work/err"
rc=$?
[ $rc != 0 ] && grep -q "^miss-target-study: the replay t0-tiny mt-0.0[1-5] (.*--miss-measure bogus) failed" \
  "$work/err" && grep -q "bogus not in {estimate,exact}" "$work/err" && [ ! -e "$work/bad.md" ] &&
  pass "a failed replay is named and stops the study" || fail "failed replay: rc $rc, $(cat "$work/err")"

# Not a trace: refused, nothing written.
mkdir "$work/empty"
bash "$study" "$spinctl" "$work/none.md" "$work/empty" >/dev/null 2>"$work/err"
rc=$?
[ $rc = 2 ] && grep -q "has no meta.json (not a trace)" "$work/err" && [ ! -e "$work/none.md" ] &&
  pass "a directory without a trace is refused" || fail "not-a-trace: rc $rc, $(cat "$work/err")"

[ $fails = 0 ] && echo "all passed" || echo "$fails failed"
[ $fails = 0 ]
