#!/bin/bash
# The engine library links no tool code: no strong symbol defined by the tool libraries (trace
# I/O, generator, replay, eval, spinctl) and nothing of CLI11 may be defined in a binary that
# links only libspin_client.
#   link_boundary_test.sh expect-none|expect-some BINARY TOOL_LIB.a...
# expect-some checks the checker: run on spinctl, it must find those symbols.
set -euo pipefail
mode=$1 bin=$2
shift 2
tool_syms=$(mktemp) bin_syms=$(mktemp)
trap 'rm -f "$tool_syms" "$bin_syms"' EXIT
# Strong global text symbols (type T) the tool libraries define, mangled.
for lib in "$@"; do
  nm --defined-only "$lib" 2>/dev/null | awk '$2 == "T" {print $3}'
done | sort -u >"$tool_syms"
if [[ ! -s $tool_syms ]]; then
  echo "no symbols read from the tool libraries: $*" >&2
  exit 1
fi
nm --defined-only "$bin" | awk '{print $3}' | sort -u >"$bin_syms"
shared=$(comm -12 "$tool_syms" "$bin_syms" | wc -l)
cli=$(nm -C --defined-only "$bin" | grep -c ' CLI::' || true)
echo "$(basename "$bin"): $shared of $(wc -l <"$tool_syms") tool symbols, $cli CLI11 symbols"
case $mode in
  expect-none)
    if (( shared > 0 || cli > 0 )); then
      comm -12 "$tool_syms" "$bin_syms" | head -20 | c++filt >&2
      echo "FAIL: $(basename "$bin") links tool code" >&2
      exit 1
    fi ;;
  expect-some)
    if (( shared == 0 || cli == 0 )); then
      echo "FAIL: the check found no tool code in $(basename "$bin"), which links it" >&2
      exit 1
    fi ;;
  *) echo "mode: expect-none or expect-some" >&2; exit 2 ;;
esac
