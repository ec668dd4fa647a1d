#!/usr/bin/env bash
# test_disagg: disaggregated prefill/decode over the tcp data plane, with
# real `pdserve serve` processes and a test driver (disagg.test.js) that
# plays the proxy's three hops. One colocated instance is the reference; one
# prefill/decode pair per send type (PUT, PUT_ASYNC, GET), each pair with
# different block sizes on the two sides; plus instances for the fault tests.
set -u
bin=${PDSERVE_BIN:?}
src=${PDSERVE_SRC:?}
dir="$src/tests/connector"
. "$src/tests/common/servers.sh"
servers_need_node
servers_init KILL
"$bin" make-model "$tmp/model" --preset tiny --seed 11 2>/dev/null || { echo "FAIL: make-model"; exit 1; }

# Free TCP ports for the KV control planes.
freeport() { free_ports 1; }

start() { # name, then serve flags; exports URL_<name>
  local name=$1; shift
  serve_start "$name" --max-model-len 256 --num-gpu-blocks-override 256 \
    --log-level "${PD_LOG_LEVEL:-info}" "$@"
  export "URL_$name"
}

kvcfg() { # role port send_type [extra json fields]
  printf '{"kv_connector":"P2pNcclConnector","kv_role":"%s","kv_ip":"127.0.0.1","kv_port":%s,"kv_buffer_size":"1e8","kv_connector_extra_config":{"send_type":"%s","timeout_s":%s%s}}' \
    "$1" "$2" "$3" "${TIMEOUT:-10}" "${4:-}"
}

start colo --block-size 16
i=0
for st in PUT PUT_ASYNC GET; do
  pp=$(freeport); dp=$(freeport)
  bs_p=$((16 << (i % 2))); bs_d=$((8 << i))
  # The GET pair moves its KV over three TCP connections (tcp_streams; the
  # decode instance pulls, so its connections carry the layers).
  streams=; [ $st = GET ] && streams=',"tcp_streams":3'
  start "p_$st" --block-size $bs_p --kv-transfer-config "$(kvcfg kv_producer "$pp" "$st" "$streams")"
  # The PUT_ASYNC decode instance asks for recv_into_pinned, which a CPU
  # backend has no page-locked memory for: accepted, explained in its log,
  # and nothing copied (test_connector runs the path itself, emulated).
  extra=$streams; [ $st = PUT_ASYNC ] && extra=',"recv_into_pinned":true'
  start "d_$st" --block-size $bs_d --kv-transfer-config "$(kvcfg kv_consumer "$dp" "$st" "$extra")"
  export "KV_p_$st=127.0.0.1:$pp" "KV_d_$st=127.0.0.1:$dp"
  i=$((i + 1))
done
# Fault-test instances: short deadlines; a consumer with a kv buffer too
# small for one request; a consumer we kill while KV is in flight.
TIMEOUT=2
fp=$(freeport); fd=$(freeport); fs=$(freeport); fk=$(freeport)
start p_fault --kv-transfer-config "$(kvcfg kv_producer "$fp" PUT)"
start pa_fault --kv-transfer-config "$(kvcfg kv_producer "$(freeport)" PUT_ASYNC)"
start d_fault --kv-transfer-config "$(kvcfg kv_consumer "$fd" PUT)"
start d_small --kv-transfer-config "$(printf '{"kv_connector":"P2pNcclConnector","kv_role":"kv_consumer","kv_ip":"127.0.0.1","kv_port":%s,"kv_buffer_size":1000,"kv_connector_extra_config":{"send_type":"PUT","timeout_s":2}}' "$fs")"
start d_kill --kv-transfer-config "$(kvcfg kv_consumer "$fk" PUT_ASYNC)"
# A consumer that computes the prompt itself when its KV does not come
# (vLLM's kv_load_failure_policy "recompute").
fr=$(freeport)
start d_recompute --kv-transfer-config "$(printf '{"kv_connector":"P2pNcclConnector","kv_role":"kv_consumer","kv_ip":"127.0.0.1","kv_port":%s,"kv_load_failure_policy":"recompute","kv_connector_extra_config":{"send_type":"PUT","timeout_s":2}}' "$fr")"
export KV_d_recompute=127.0.0.1:$fr
# A GET-mode pair whose prefill we kill after it answered, with its KV still held for the pull.
gp=$(freeport); gd=$(freeport)
start pg_kill --kv-transfer-config "$(kvcfg kv_producer "$gp" GET)"
start dg_fault --kv-transfer-config "$(kvcfg kv_consumer "$gd" GET)"
export KV_dg_fault=127.0.0.1:$gd PID_pg_kill
export KV_p_fault=127.0.0.1:$fp KV_d_fault=127.0.0.1:$fd KV_d_small=127.0.0.1:$fs KV_d_kill=127.0.0.1:$fk
export PID_d_kill LOG_DIR=$tmp

fail=0
node --test --test-reporter=spec "$dir/disagg.test.js" || fail=1
if [ $fail -ne 0 ]; then
  for f in "$tmp"/*.log; do echo "--- $(basename "$f") (tail)"; tail -8 "$f"; done
fi
# The decode logs say the same as its metrics: a request whose KV came from
# a prefill computed exactly one prompt token ("N from a remote prefill, 1
# computed"), for the ~100 prompts of each send type.
for st in PUT PUT_ASYNC GET; do
  log="$tmp/d_$st.log"
  remote=$(grep -c ' [1-9][0-9]* from a remote prefill, 1 computed)' "$log")
  wrong=$(grep ' [1-9][0-9]* from a remote prefill, ' "$log" | grep -vc ', 1 computed)')
  if [ "$remote" -ge 90 ] && [ "$wrong" -eq 0 ]; then
    echo "ok: d_$st log: $remote requests computed only their last prompt token"
  else
    echo "FAIL: d_$st log: $remote requests with remote KV and 1 computed token, $wrong with more"
    fail=1
  fi
done
pool=$(curl -s "$URL_d_PUT_ASYNC/metrics" | awk '$1 ~ /^pdserve:kv_host_pool_(pinned|pageable)_bytes[{]/ {s += $2} END {print s + 0}')
if grep -q 'recv_into_pinned is ignored: this backend has no page-locked memory' "$tmp/d_PUT_ASYNC.log" &&
  [ "$pool" = 0 ]; then
  echo "ok: d_PUT_ASYNC says recv_into_pinned has no page-locked memory on the CPU, and its pool holds nothing"
else
  echo "FAIL: d_PUT_ASYNC: no log line for recv_into_pinned on the CPU, or its pool holds $pool bytes"
  fail=1
fi
# The GET decode instance pulled over three connections to its prefill
# (tcp_streams 3; more are open to the dead address a fault test used); the
# PUT_ASYNC prefill pushed over one.
for st in PUT_ASYNC GET; do
  v=URL_$( [ $st = GET ] && echo d || echo p )_$st
  want=$( [ $st = GET ] && echo 3 || echo 1 )
  conns=$(curl -s "${!v}/metrics" | awk '$1 ~ /^pdserve:kv_peer_connections[{]/ {s += $2} END {print s + 0}')
  if { [ $st = GET ] && [ "$conns" -ge 3 ]; } || [ "$conns" = "$want" ]; then
    echo "ok: ${v#URL_} has $conns KV connection(s) open (tcp_streams $want)"
  else
    echo "FAIL: ${v#URL_} has $conns KV connection(s) open (tcp_streams $want)"
    fail=1
  fi
done
# A decode instance with blocks to spare gives a request waiting for KV its
# blocks at once and writes each layer as it arrives; its metrics count those
# layers apart from the ones written at admission (when blocks were short).
metric() { curl -s "$1/metrics" | awk -v n="$2" '$1 ~ "^"n"[{]" {s += $2} END {print s + 0}'; }
for st in PUT PUT_ASYNC GET; do
  v=URL_d_$st
  all=$(metric "${!v}" pdserve:kv_layers_written_total)
  early=$(metric "${!v}" pdserve:kv_layers_written_on_arrival_total)
  if [ "$early" -gt 0 ] && [ "$early" -le "$all" ]; then
    echo "ok: d_$st wrote $early of $all received layers into the cache as they arrived"
  else
    echo "FAIL: d_$st: $early of $all layers written as they arrived"
    fail=1
  fi
done
# Every instance still alive and healthy after the faults (but the one we killed).
for v in $(compgen -v URL_); do
  url=${!v}
  [ "$v" = URL_d_kill ] || [ "$v" = URL_pg_kill ] && continue
  code=$(curl -s -o /dev/null -w '%{http_code}' "$url/health")
  [ "$code" = 200 ] || { echo "FAIL: $v not healthy after the tests ($code)"; fail=1; }
done
[ $fail -eq 0 ] && echo "disaggregation tests: all passed"
exit $fail
