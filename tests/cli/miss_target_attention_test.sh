#!/usr/bin/env bash
# The miss target on real attention (issue 36 item 2): `spinctl replay --miss-target M
# --probe-period 8`, as a user runs it, on the committed real-attention traces.
# - bench/traces/attn-cpu-2560 (4 layers, 2560 slots): the worst layer's realized mean miss
#   stays within 1.1 M at every M. The controller before 077f93d let doc0 reach 1.138 M at
#   M 0.01 and 1.183 M at 0.03.
# - bench/traces/attn-h100-32k-seed2-b/doc9-L1-3 (3 layers, 32K slots, float16): within 1.1 M
#   at M 0.02, 0.03 and 0.05. At M 0.01 the promise does NOT hold on this trace (1.21 M at
#   c24302d, the estimate's noise at small M: docs/budgets.md, "Not held on long real
#   attention"); that run is held to 1.25 M, a regression bound, not the promise. The
#   probes-only controller of 8d6669b gives 1.66, 1.68, 1.54 and 1.43 M on this trace.
# - `--miss-measure exact` (the controller measures every sparse step's realized miss instead
#   of the exploration estimate, an offline diagnostic): on the 32K trace it holds 1.1 M at
#   every M, M 0.01 included, which locates the overshoot in the estimate, not the controller
#   (its refusals are in spinctl_test.sh).
# - Through spind (`spinctl --target ... replay --pace-ms 20`, the daemon's probe thread running
#   the controller on its own clock): the 32K trace within 1.1 M at M 0.02 and 1.25 M at 0.01,
#   at about the offline run's effective sparsity. Before 2026-12-07's fix a miss-target session
#   started at the uniform --sparsity table until the probe thread's first pass, and the thread
#   read it every 100 ms, a table per five steps or so: 1.34-1.40 M at M 0.01 and 1.10-1.39 M at
#   0.02 (pace 20), 2.2-4.5 M at 0.01 unpaced.
# - Remote mode (--remote): exactly the offline replay at M 0.01, 0.02 and 0.05, estimates
#   included, and on a generated 3-row MTP trace.
# Usage: miss_target_attention_test.sh SPINCTL REPO SPIND
set -euo pipefail
spinctl=$1 repo=$2 spind=$3
fail=0
json=""  # the last check's replay summary
target=()  # --target unix://SOCK for the checks through spind
check() {  # check TRACE_DIR M BOUND_FACTOR [REPLAY_ARGS...]
  local worst
  json=$("$spinctl" "${target[@]}" replay --trace "$1" --miss-target "$2" --probe-period 8 \
    --json --quiet "${@:4}")
  worst=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["worst_layer_mean_miss"])' \
    <<<"$json")
  if python3 -c "import sys; sys.exit(0 if $worst <= $3 * $2 else 1)"; then
    echo "ok   $(basename "$1") M $2 ${*:4}: worst-layer mean miss $worst (<= $3 M)"
  else
    echo "FAIL $(basename "$1") M $2 ${*:4}: worst-layer mean miss $worst > $3 x $2"
    fail=1
  fi
}
for doc in doc0 doc1; do
  for m in 0.01 0.02 0.03 0.05; do check "$repo/bench/traces/attn-cpu-2560/$doc" "$m" 1.1; done
done
long="$repo/bench/traces/attn-h100-32k-seed2-b/doc9-L1-3"
check "$long" 0.01 1.25
est=$json
for m in 0.02 0.03 0.05; do check "$long" "$m" 1.1; done
check "$long" 0.01 1.1 --miss-measure exact
exact=$json
for m in 0.02 0.03 0.05; do check "$long" "$m" 1.1 --miss-measure exact; done
# The exact measurement changes the result (the 1.25 M run above is 1.21 M with the estimate).
if [ "$est" = "$exact" ]; then
  echo "FAIL --miss-measure exact replayed exactly as the estimate"
  fail=1
fi
# Through spind, paced as an engine decodes (20 ms a step, two passes of the probe thread's
# 10 ms miss-target interval). Timing decides which step a table lands on, so the bounds leave
# room for a starved thread (a late table costs sparsity, not miss): within 1.1 M at M 0.02 and
# 1.25 M at 0.01, and no sparser than offline by more than 0.01 nor denser by more than 0.06.
# The spind before 2026-12-07 gave 1.34-1.40 M at M 0.01 here.
work=$(mktemp -d)
"$spind" --listen "unix://$work/s.sock" --backend cpu 2>"$work/spind.log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
ready=0
for _ in $(seq 100); do
  if "$spinctl" --target "unix://$work/s.sock" status >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.2
done
if [ $ready = 0 ]; then
  echo "FAIL spind did not answer within 20 s: $(tail -3 "$work/spind.log")"
  exit 1
fi
sparsity() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])["effective_sparsity"])' "$1"; }
for m in 0.01 0.02; do
  offline=$("$spinctl" replay --trace "$long" --miss-target "$m" --probe-period 8 --json --quiet)
  target=(--target "unix://$work/s.sock")
  if [ "$m" = 0.01 ]; then check "$long" "$m" 1.25 --pace-ms 20; else check "$long" "$m" 1.1 --pace-ms 20; fi
  target=()
  a=$(sparsity "$json") b=$(sparsity "$offline")
  if python3 -c "import sys; sys.exit(0 if $b - 0.06 <= $a <= $b + 0.01 else 1)"; then
    echo "ok   through spind M $m: effective sparsity $a (offline $b)"
  else
    echo "FAIL through spind M $m: effective sparsity $a, offline $b (outside [-0.06, +0.01])"
    fail=1
  fi
done
# Remote mode (spind gets the logits through ObserveScores, not the engine's top-K): spind takes
# the top-K from the logits itself, so its sparse steps are measured as a mapped session's are,
# and it refreshes the budgets as each step begins, after every layer of the last one, as replay
# does offline: so the remote replay is the offline one, whatever the pace, on the 32K trace and
# on a generated MTP trace (3 rows: only row 0's top-K counts). Before 2026-12-07 a remote
# session had no measurement between probes (1.7-1.9 M at M 0.02, every explore_miss 0) and its
# tables came from the probe thread's clock.
same() {  # the fields a remote replay and an offline one must share
  python3 -c 'import json,sys
d = json.loads(sys.argv[1])
print(d["effective_sparsity"], d["mean_miss"], d["worst_layer_mean_miss"],
      [(l["mean_miss"], l["explore_miss"], l["explore_steps"]) for l in d["per_layer"]])' "$1"
}
"$spinctl" gen-trace "$work/mtp" --rows 3 --layers 2 --slots 4096 --steps 48 --seed 22 >/dev/null
for run in "$long 0.01" "$long 0.02" "$long 0.05" "$work/mtp 0.05"; do
  set -- $run
  offline=$("$spinctl" replay --trace "$1" --miss-target "$2" --probe-period 8 --json --quiet)
  remote=$("$spinctl" --target "unix://$work/s.sock" replay --trace "$1" --miss-target "$2" \
    --probe-period 8 --json --quiet --remote)
  if [ "$(same "$remote")" = "$(same "$offline")" ] \
     && python3 -c 'import json,sys; sys.exit(0 if all(l["explore_steps"] > 0 for l in json.loads(sys.argv[1])["per_layer"]) else 1)' "$remote"; then
    echo "ok   remote $(basename "$1") M $2: the offline replay's misses, sparsity and estimates"
  else
    echo "FAIL remote $(basename "$1") M $2: $(same "$remote") against offline $(same "$offline")"
    fail=1
  fi
done
exit $fail
