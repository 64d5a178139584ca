#!/usr/bin/env bash
# spind's /metrics: valid for `promtool check metrics`, and a real Prometheus server on loopback
# scrapes a live spind and returns a spin_ series through its HTTP API.
set -uo pipefail
spind="$1"
helper="$2"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }

# http_get HOST PORT PATH: the body of a plain HTTP/1.0 GET (no curl on a minimal machine).
http_get() {
  exec 3<>"/dev/tcp/$1/$2" || return 1
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$1" >&3
  sed '1,/^\r$/d' <&3
  exec 3<&-
}

"$spind" --listen "unix://$work/spind.sock" --metrics-address 127.0.0.1:0 2>"$work/spind.log" &
pids+=($!)
port=""
for _ in $(seq 50); do
  port=$(grep -oE '127\.0\.0\.1:[0-9]+/metrics' "$work/spind.log" | head -n 1 | cut -d: -f2 | cut -d/ -f1)
  [ -n "$port" ] && [ -S "$work/spind.sock" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "FAIL spind did not report a metrics port"; cat "$work/spind.log"; exit 1; }
# An engine holding a session, so per-layer series exist.
"$helper" "unix://$work/spind.sock" >"$work/helper.out" &
pids+=($!)
for _ in $(seq 50); do [ -s "$work/helper.out" ] && break; sleep 0.1; done
session=$(head -n 1 "$work/helper.out")
[ -n "$session" ] || { echo "FAIL helper did not attach"; exit 1; }

http_get 127.0.0.1 "$port" /metrics >"$work/metrics.txt"
if grep -q "^spin_layer_budget_sparsity_ratio{session=\"$session\",layer=\"1\"}" "$work/metrics.txt" \
  && grep -q "^spin_layer_explore_miss_ratio{session=\"$session\",layer=\"1\"}" "$work/metrics.txt" \
  && grep -q "^spin_session_explore_miss_ratio{session=\"$session\"}" "$work/metrics.txt" \
  && grep -q '^spin_sessions 1' "$work/metrics.txt" && grep -q '^spin_build_info{' "$work/metrics.txt" \
  && grep -q '^grpc_server_handled_total{grpc_code="OK",grpc_method="Attach"' "$work/metrics.txt"; then
  pass "/metrics has the spin and gRPC series"
else
  fail "/metrics content: $(head -c 600 "$work/metrics.txt")"
fi
# Every series the Grafana dashboard queries is one spind exports.
dashboard="$(dirname "$0")/../../helm/spind/dashboards/spind-dashboard.json"
missing=""
names=$(grep -oE '(spin|grpc_server)_[a-z_]+' "$dashboard" | sort -u)
checked=0
for name in $names; do
  checked=$((checked + 1))
  grep -q "^$name[{ ]" "$work/metrics.txt" || missing="$missing $name"
done
# A missing or unreadable dashboard gives no names: the loop must have checked some.
[ "$checked" -ge 5 ] && [ -z "$missing" ] \
  && pass "dashboard queries only exported series ($checked names)" \
  || fail "dashboard ($dashboard, $checked names) names series spind does not export:$missing"
if promtool check metrics <"$work/metrics.txt" >"$work/promtool.out" 2>&1; then
  pass "promtool check metrics"
else
  fail "promtool check metrics: $(cat "$work/promtool.out")"
fi

# A real Prometheus on loopback, scraping spind every second.
cat >"$work/prometheus.yml" <<YML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: spind
    static_configs:
      - targets: ['127.0.0.1:$port']
YML
prom_port=""
for try in 1 2 3 4 5; do
  candidate=$((20000 + (RANDOM % 20000)))
  prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$candidate" >"$work/prometheus.log" 2>&1 &
  ppid=$!
  for _ in $(seq 50); do
    if http_get 127.0.0.1 "$candidate" /-/ready 2>/dev/null | grep -qi ready; then
      prom_port=$candidate
      break
    fi
    kill -0 "$ppid" 2>/dev/null || break
    sleep 0.2
  done
  if [ -n "$prom_port" ]; then pids+=("$ppid"); break; fi
  kill "$ppid" 2>/dev/null
done
[ -n "$prom_port" ] || { echo "FAIL prometheus did not start"; tail -5 "$work/prometheus.log"; exit 1; }
found=""
for _ in $(seq 60); do
  body=$(http_get 127.0.0.1 "$prom_port" "/api/v1/query?query=spin_layer_budget_sparsity_ratio")
  if echo "$body" | grep -q "\"session\":\"$session\""; then found=yes; break; fi
  sleep 0.5
done
[ -n "$found" ] && pass "Prometheus scraped spind: spin_layer_budget_sparsity_ratio{session=$session}" \
  || fail "Prometheus query: $body"
echo "metrics: $fails failed"
exit $((fails > 0))
