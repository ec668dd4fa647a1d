#!/usr/bin/env bash
# test_gpu_disagg_py: scripts/gpu-disagg.py (the GPU machine's disaggregation
# check, Python only) run on the CPU with the tiny model: it must start
# pdproxy + prefill + decode + colocated, pass its own correctness check
# (identical outputs, one computed prompt token per request on the decode
# side), print the TTFT/TPOT table, and leave no process behind. A second
# run with a transport that cannot start here must fail cleanly and say why.
set -u
bin=${PDSERVE_BIN:?}
src=${PDSERVE_SRC:?}
build=${PDSERVE_BUILD:-$(dirname "$bin")}
. "$(dirname "$0")/../common/checks.sh"
command -v python3 >/dev/null || { echo "FAIL: python3 not installed"; exit 1; }
"$bin" make-model "$tmp/m" --preset tiny --seed 4 >/dev/null 2>&1 || { echo "FAIL: make-model"; exit 1; }

run() { python3 "$src/scripts/gpu-disagg.py" "$tmp/m" --device cpu --pdserve "$bin" --pdproxy "$build/pdproxy" "$@"; }
children() { pgrep -f -- "$tmp/m" | grep -v "^$$\$" | wc -l; }

# (over two TCP connections a peer: the tcp_streams option bench-gpu measures)
run --check-dtype float32 --dtype float16 --requests 12 --max-tokens 8 --bench-lengths 16,200 \
  --concurrency 1,3 --bench-requests 3 --tcp-streams 2 --json "$tmp/s.json" >"$tmp/out" 2>&1
rc=$?
[ $rc -eq 0 ] && ok || bad "gpu-disagg.py on the CPU exited $rc: $(tail -30 "$tmp/out")"
grep -q 'vs colocated: 0 differ' "$tmp/out" && ok || bad "outputs differ: $(grep -A3 correctness "$tmp/out")"
grep -q 'decode instance computed 15 prompt tokens for 15 proxied requests' "$tmp/out" && ok ||
  bad "decode should compute one prompt token per request: $(grep 'decode instance' "$tmp/out")"
[ "$(grep -c '^| 200 | [13] | \(1P1D\|colocated\) | 3 |' "$tmp/out")" -eq 4 ] && ok || bad "TTFT/TPOT table: $(grep '^|' "$tmp/out")"
python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert j["passed"] and len(j["bench"]) == 8' "$tmp/s.json" &&
  ok || bad "summary json"
[ "$(children)" -eq 0 ] && ok || bad "processes left behind: $(pgrep -af -- "$tmp/m")"

# nccl cannot start on CPU instances: a clean failure naming the log, no leftovers.
if nvidia-smi -L >/dev/null 2>&1; then
  checks_done "the no-GPU failure case skipped: a GPU is visible"
  exit
fi
run --transport nccl --check-dtype float32 --skip-bench --start-timeout 30 >"$tmp/out2" 2>&1
rc=$?
[ $rc -eq 1 ] && ok || bad "nccl run should fail with 1, got $rc"
grep -q 'gpu-disagg: FAIL: .*exited' "$tmp/out2" && grep -q 'last .* lines ---' "$tmp/out2" && ok ||
  bad "failure report: $(tail -20 "$tmp/out2")"
# The instance itself says why: nccl sends from GPU memory, the KV is on the CPU.
grep -q 'transport "nccl" sends KV from GPU memory.*--device cuda' "$tmp/out2" && ok ||
  bad "the server log should say nccl needs the KV on a GPU: $(grep -i nccl "$tmp/out2" | head -5)"
[ "$(children)" -eq 0 ] && ok || bad "processes left behind after the failure"

checks_done
