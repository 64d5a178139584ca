#!/usr/bin/env bash
# Two processes on one GPU: spind --backend cuda allocates each session's arena with CUDA VMM
# and hands it out as a POSIX fd; spinctl (libspin_client) imports it, maps it on the same GPU
# and runs the CUDA data plane on it. Checks: replay through the daemon's GPU arena and through
# remote mode (staged to the device by the daemon) equal offline CPU replay byte for byte;
# SIGKILLed clients' GPU arenas are reclaimed with no device-memory growth; metrics carry the
# GPU's UUID. Exits 77 (skipped) without a GPU, or 1 (failed) without one when
# SPIN_REQUIRE_GPU=1 (scripts/gpu-check sets it: a GPU run must not pass with nothing run).
# Usage: spind_cuda_test.sh SPINCTL SPIND ATTACH_HELPER
set -uo pipefail
spinctl="$1"
spind="$2"
helper="$3"
if ! smi=$(nvidia-smi -L 2>&1) || ! grep -q "^GPU " <<<"$smi"; then
  why="nvidia-smi -L lists no GPU: $(head -c 300 <<<"$smi")"
  if [ "${SPIN_REQUIRE_GPU:-}" = 1 ]; then
    echo "FAIL: SPIN_REQUIRE_GPU=1 but no usable GPU ($why)"
    exit 1
  fi
  echo "SKIP: no GPU ($why; set SPIN_REQUIRE_GPU=1 to make this a failure)"
  exit 77
fi
work="$(mktemp -d)"
sock="$work/spind.sock"
"$spind" --listen "unix://$sock" --backend cuda --metrics-address 127.0.0.1:0 \
  --client-grace-ms 200 2>"$work/spind.log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }
ctl() { "$spinctl" --target "unix://$sock" "$@"; }
for _ in $(seq 100); do
  ctl status >/dev/null 2>&1 && break
  sleep 0.2
done
ctl status || { cat "$work/spind.log"; exit 1; }
grep -q "backend cuda, device 0 GPU-" "$work/spind.log" && pass "spind on the GPU" \
  || fail "spind backend: $(cat "$work/spind.log")"
# The GPU's link: <GPU UUID>.sock next to the socket leads to it (engines find their GPU's
# spind by the UUID they see), and replay through the link works.
uuid=$(grep -o "backend cuda, device 0 GPU-[0-9a-f-]*" "$work/spind.log" | sed 's/.*device 0 //')
link="$work/$uuid.sock"
[ -n "$uuid" ] && [ "$(readlink "$link")" = "spind.sock" ] \
  && "$spinctl" --target "unix://$link" health >/dev/null && pass "gpu link $link" \
  || fail "gpu link: '$link' -> '$(readlink "$link")'; $(ls "$work")"
port=$(sed -n 's/.*metrics on http:\/\/127.0.0.1:\([0-9]*\)\/metrics.*/\1/p' "$work/spind.log")
scrape() {
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())"
}
gpu_mib() {  # device memory spind holds, MiB
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
    | awk -F', *' -v p="$pid" '$1 == p {print $2}'
}

"$spinctl" gen-trace "$work/t1" --layers 4 --slots 8192 --steps 64 --topk 512 --seed 31 \
  >"$work/gen.log" 2>&1 || fail "gen-trace t1: $(tail -2 "$work/gen.log")"
"$spinctl" gen-trace "$work/t3" --layers 3 --slots 6000 --steps 48 --topk 256 --rows 3 \
  --seed 32 >"$work/gen.log" 2>&1 || fail "gen-trace t3: $(tail -2 "$work/gen.log")"
# The dumps have one line per (step, layer): 64 x 4 for t1, 48 x 3 for t3.
for cfg in "fp32 t1 256" "bf16 t1 256" "fp32 t3 144" "bf16 t3 144"; do
  set -- $cfg
  args=(--trace "$work/$2" --state "$1" --sparsity 0.5 --exploration 0.1 --probe-period 8
    --quiet)
  rm -f "$work/off" "$work/loc" "$work/rem"
  "$spinctl" replay "${args[@]}" --dump "$work/off" >/dev/null 2>"$work/off.err" \
    || fail "$1 $2: offline replay: $(tail -2 "$work/off.err")"
  lines=$(wc -l <"$work/off" 2>/dev/null || echo 0)
  [ "$lines" -eq "$3" ] && pass "$1 $2: offline dump has $3 lines" \
    || fail "$1 $2: offline dump has ${lines} lines, not $3"
  ctl replay "${args[@]}" --backend cuda --dump "$work/loc" >"$work/loc.out" 2>&1
  ctl replay "${args[@]}" --remote --dump "$work/rem" >"$work/rem.out" 2>&1
  if [ -s "$work/off" ] && cmp -s "$work/off" "$work/loc" \
    && grep -q "mapped arena, GPU GPU-" "$work/loc.out"; then
    pass "$1 $2: replay on the daemon's GPU arena (client CUDA kernels) = offline CPU"
  else
    fail "$1 $2: mapped GPU arena replay: $(tail -2 "$work/loc.out")"
  fi
  if [ -s "$work/off" ] && cmp -s "$work/off" "$work/rem" \
    && grep -q "remote mode, GPU GPU-" "$work/rem.out"; then
    pass "$1 $2: remote mode on the GPU arena = offline CPU"
  else
    fail "$1 $2: remote replay: $(tail -2 "$work/rem.out")"
  fi
done

# An attached session shows up with its GPU; metrics carry the gpu and UUID labels.
"$helper" "unix://$sock" >"$work/id" 2>"$work/helper.err" &
hp=$!
for _ in $(seq 50); do [ -s "$work/id" ] && break; sleep 0.1; done
ctl sessions | grep -q "cuda" && pass "sessions lists a cuda session" \
  || fail "sessions: $(ctl sessions 2>&1)"
scrape >"$work/metrics"
grep -q '^spin_sessions{.*UUID="GPU-' "$work/metrics" && grep -q 'gpu="0"' "$work/metrics" \
  && grep -q 'backend="cuda"' "$work/metrics" && pass "metrics carry gpu and UUID labels" \
  || fail "metrics labels: $(grep '^spin_sessions' "$work/metrics")"
kill -9 $hp
wait $hp 2>/dev/null

# Crashed engines: 20 clients attach (1+ MiB of GPU arena each) and are SIGKILLed; every arena
# is freed after the grace period and spind's device memory does not grow.
sleep 1
base=$(gpu_mib)
attached=0
for i in $(seq 20); do
  : >"$work/id"
  "$helper" "unix://$sock" >"$work/id" 2>>"$work/helper.err" &
  hp=$!
  for _ in $(seq 50); do [ -s "$work/id" ] && break; sleep 0.1; done
  [ -s "$work/id" ] && attached=$((attached + 1))
  kill -9 $hp
  wait $hp 2>/dev/null
done
# Without this, clients that never attached would make "every arena freed" pass vacuously.
[ "$attached" -eq 20 ] && pass "20 clients attached before being killed" \
  || fail "only $attached of 20 clients attached: $(tail -2 "$work/helper.err")"
for _ in $(seq 50); do
  ctl status | grep -q "serving, 0 sessions" && break
  sleep 0.1
done
sleep 0.5
after=$(gpu_mib)
ctl status | grep -q "serving, 0 sessions" && pass "20 killed clients: every GPU arena freed" \
  || fail "killed clients: $(ctl status)"
[ -n "$base" ] && [ -n "$after" ] && [ "$after" -le "$base" ] \
  && pass "spind device memory ${base} MiB before, ${after} MiB after" \
  || fail "device memory grew: ${base} -> ${after} MiB"

# A stopped spind removes its GPU link with its socket.
kill -TERM "$pid"; wait "$pid"
[ ! -e "$link" ] && [ ! -L "$link" ] && pass "gpu link removed at exit" \
  || fail "gpu link left after exit: $(ls -l "$work")"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
