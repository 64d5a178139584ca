#!/usr/bin/env bash
# The image's own spind and spinctl (scripts/image-bundle) on a GPU: spind on the CUDA backend
# serves health, makes its GPU UUID link, and a replay through that link with the CUDA data
# plane on the mapped arena equals the offline CPU replay byte for byte. Logs under $OUT/img.
set -u
B="$PWD/image-bundle"
export LD_LIBRARY_PATH="$B/lib"
o="${OUT:-out}/img"
mkdir -p "$o"
w=$(mktemp -d)
echo "spind from the image (revision $(cat "$B/REVISION")) on $(nvidia-smi -L | head -1)"
"$B/spind" --listen "unix://$w/spind.sock" --backend cuda >"$o/spind.log" 2>&1 &
pid=$!
for _ in $(seq 50); do
  "$B/spinctl" --target "unix://$w/spind.sock" health >/dev/null 2>&1 && break
  sleep 0.2
done
"$B/spinctl" --target "unix://$w/spind.sock" health || exit 1
"$B/spinctl" gen-trace "$w/t" --layers 4 --slots 16384 --steps 64 --topk 512 --rows 2 --seed 5 \
  >/dev/null
args=(--trace "$w/t" --sparsity 0.5 --exploration 0.1 --probe-period 8 --quiet)
"$B/spinctl" replay "${args[@]}" --dump "$w/off" >/dev/null
link=$(cd "$w" && ls GPU-*.sock)
"$B/spinctl" --target "unix://$w/$link" replay "${args[@]}" --backend cuda --dump "$w/gpu" \
  >"$o/replay.out" 2>&1
tail -1 "$o/replay.out"
rc=0
if cmp -s "$w/off" "$w/gpu" && grep -q "mapped arena, GPU" "$o/replay.out"; then
  echo "PASS: the image's spind on the CUDA backend, replay through $link = offline CPU ($(wc -l <"$w/off") lines)"
else
  echo "FAIL: $(cmp "$w/off" "$w/gpu" 2>&1)"
  rc=1
fi
kill -TERM "$pid"
wait "$pid"
cat "$o/spind.log"
rm -rf "$w"
exit $rc
