#!/usr/bin/env bash
# test_proxy: pdproxy end to end. Starts, as real processes on the tiny
# built-in model: one colocated pdserve (the reference), a 1P1D stack and a
# 2P2D stack, each with its own pdproxy; the instances find their proxy only
# through ZMQ announcements (--kv-transfer-config with proxy_ip/proxy_port).
# Then runs the Node suites in tests/proxy (run.js): greedy outputs through
# both stacks equal the reference, the OpenAI SDK, protocol conformance and
# failure handling against fake instances, and instances joining and leaving
# under load.
set -u
bin=${PDSERVE_BIN:?}
src=${PDSERVE_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
build=${PDSERVE_BUILD:-$(dirname "$bin")}
proxy=$build/pdproxy
dir="$src/tests/proxy"
. "$src/tests/common/servers.sh"
# The `openai` package comes from tests/server/node_modules (installed there
# from tests/server/package.json when missing), found through NODE_PATH.
servers_need_node
[ -x "$proxy" ] || { echo "FAIL: $proxy not built"; exit 1; }
export NODE_PATH="$src/tests/server/node_modules"
servers_init

"$bin" make-model "$tmp/model" --preset tiny --seed 1 >/dev/null 2>"$tmp/mm.err" || { cat "$tmp/mm.err"; exit 1; }

# Free TCP ports, all distinct (the kernel hands out unused ones).
ports=($(free_ports 24))
next_port=0
port() { echo "${ports[$next_port]}"; }

export PDSERVE_ANNOUNCE_INTERVAL_MS=200

# proxy NAME DISCOVERY_PORT: a pdproxy on a fresh HTTP port.
start_proxy() {
  local name=$1 dport=$2 hport=${ports[$next_port]}; next_port=$((next_port + 1))
  "$proxy" --host 127.0.0.1 --port "$hport" --discovery-port "$dport" --instance-timeout 1 \
    --timeout 20 --failure-backoff 1 >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  printf -v "URL_$name" 'http://127.0.0.1:%s' "$hport"
}
# instance NAME ROLE DISCOVERY_PORT: pdserve announcing itself to that proxy.
start_instance() {
  local name=$1 role=$2 dport=$3
  local h=${ports[$next_port]} k=${ports[$((next_port + 1))]}; next_port=$((next_port + 2))
  local cfg="{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"$role\",\"kv_port\":$k,\"kv_ip\":\"127.0.0.1\",\"kv_connector_extra_config\":{\"proxy_ip\":\"127.0.0.1\",\"proxy_port\":\"$dport\",\"http_port\":\"$h\"}}"
  "$bin" serve "$tmp/model" --host 127.0.0.1 --port "$h" --threads 1 --served-model-name tiny \
    --kv-transfer-config "$cfg" >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  printf -v "PID_$name" '%s' "$!"
}

d1=${ports[0]}; d2=${ports[1]}; next_port=2
"$bin" serve "$tmp/model" --host 127.0.0.1 --port "${ports[2]}" --threads 1 --served-model-name tiny >"$tmp/ref.log" 2>&1 &
pids+=($!); URL_ref="http://127.0.0.1:${ports[2]}"; next_port=3
start_proxy one "$d1"
start_proxy two "$d2"
start_instance p1 kv_producer "$d1"
start_instance d1 kv_consumer "$d1"
start_instance p2a kv_producer "$d2"
start_instance p2b kv_producer "$d2"
start_instance d2a kv_consumer "$d2"
start_instance d2b kv_consumer "$d2"

export PD_URL_REF=$URL_ref PD_URL_ONE=$URL_one PD_URL_TWO=$URL_two PD_DISCOVERY_TWO=$d2
export PD_KILL_PIDS="$PID_p2a,$PID_d2a" PD_MODEL_DIR="$tmp/model" PDPROXY_BIN=$proxy
export PD_SPARE_PORTS="${ports[*]:$next_port}" PD_TMP=$tmp
fail=0
node "$dir/run.js" "$@" || fail=1

# scripts/bench-serve through the 1P1D proxy: every request completes, with
# exactly the asked-for tokens, and the report has vllm bench serve's figures.
node "$src/scripts/bench-serve" --base-url "$URL_one" --num-prompts 8 --random-input-len 24 \
  --random-output-len 6 --max-concurrency 4 --ignore-eos --seed 5 --result-json "$tmp/bench.json" \
  >"$tmp/bench.out" 2>&1 || { echo "FAIL: bench-serve through the proxy: $(tail -5 "$tmp/bench.out")"; fail=1; }
if node -e '
  const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
  const ok = r.completed === 8 && r.failed === 0 && r.total_output_tokens === 48 &&
    r.total_input_tokens === 192 && r.mean_ttft_ms > 0 && r.p99_tpot_ms > 0 && r.output_throughput > 0;
  process.exit(ok ? 0 : 1);' "$tmp/bench.json" 2>/dev/null && grep -q "Successful requests: *8" "$tmp/bench.out"; then
  echo "ok: bench-serve through the proxy (8 of 8, 48 output tokens)"
else
  echo "FAIL: bench-serve through the proxy: $(cat "$tmp/bench.json" 2>/dev/null | head -c 600)"
  fail=1
fi

# Clean shutdown of a proxy: SIGTERM -> exit status 0 with a "stopped" line.
kill -TERM "${pids[1]}"
if wait "${pids[1]}"; then echo "ok: pdproxy SIGTERM exit 0"; else echo "FAIL: pdproxy exit status $? after SIGTERM"; fail=1; fi
grep -q "stopped" "$tmp/one.log" || { echo "FAIL: no 'stopped' line"; fail=1; }
# Flags: an unknown one is a one-line error naming it (exit 2); bad values too.
"$proxy" --no-such-flag 1 >/dev/null 2>"$tmp/flag.err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--no-such-flag" "$tmp/flag.err" && [ "$(wc -l <"$tmp/flag.err")" -eq 1 ] || { echo "FAIL: unknown flag (rc $rc): $(cat "$tmp/flag.err")"; fail=1; }
"$proxy" --routing fastest >/dev/null 2>"$tmp/r.err"; rc=$?
[ $rc -eq 2 ] && grep -q "fastest" "$tmp/r.err" || { echo "FAIL: bad --routing (rc $rc)"; fail=1; }
"$proxy" --prefill nohost >/dev/null 2>"$tmp/s.err"; rc=$?
[ $rc -eq 2 ] && grep -q "nohost" "$tmp/s.err" || { echo "FAIL: bad --prefill (rc $rc): $(cat "$tmp/s.err")"; fail=1; }
"$proxy" --help | grep -q -- "--discovery-port" || { echo "FAIL: --help"; fail=1; }
# The per-request log line names P and D and the timings.
grep -qE "request .* P=127.0.0.1:[0-9]+ D=127.0.0.1:[0-9]+ prefill_ms=[0-9.]+ ttft_ms=[0-9.]+ total_ms=[0-9.]+ .*status=200" "$tmp/two.log" || { echo "FAIL: no per-request log line"; fail=1; }
grep -q "discovery: removed prefill instance" "$tmp/two.log" || { echo "FAIL: no 'removed' log line after a kill"; fail=1; }
if [ $fail -ne 0 ]; then
  for n in one two p1 d1 p2a d2a; do echo "--- $n log (tail)"; tail -5 "$tmp/$n.log"; done
fi
exit $fail
