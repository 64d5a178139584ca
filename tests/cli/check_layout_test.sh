#!/bin/bash
# scripts/check-layout passes on the repository and catches a forbidden arrow in a small tree.
#   check_layout_test.sh REPO
set -euo pipefail
repo=$1
bash "$repo/scripts/check-layout" "$repo"
fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
mkdir -p "$fake"/{kernels/include/spin,proto,client,service,tools/x}
echo '#include "spin/a.h"' >"$fake/service/s.cc"
echo '#include "c.h"' >"$fake/tools/x/t.cc"
echo 'int a;' >"$fake/kernels/include/spin/a.h"
echo 'int c;' >"$fake/client/c.h"
bash "$repo/scripts/check-layout" "$fake" >/dev/null  # allowed arrows only
echo '#include "c.h"' >"$fake/service/bad.cc"         # service -> client
if out=$(bash "$repo/scripts/check-layout" "$fake" 2>&1); then
  echo "FAIL: check-layout accepted service -> client" >&2
  exit 1
fi
grep -q 'service  -> client .*FORBIDDEN' <<<"$out" || { echo "FAIL: $out" >&2; exit 1; }
echo "ok: forbidden arrow caught"
