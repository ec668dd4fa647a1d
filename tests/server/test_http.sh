#!/usr/bin/env bash
# test_http: the HTTP API end to end. Starts real `pdserve serve` processes on
# the tiny built-in model (an ordinary one, one with --api-key, one with a
# tiny KV budget, one with a one-request queue), runs the Node suites in
# tests/server (OpenAI SDK, raw HTTP, bad-input corpus, serving behaviour)
# against them, and checks that SIGTERM stops a server cleanly (exit 0).
# Installs the `openai` npm package into tests/server/node_modules if missing.
set -u
bin=${PDSERVE_BIN:?}
src=${PDSERVE_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
dir="$src/tests/server"
. "$src/tests/common/servers.sh"
servers_need_node
servers_init

"$bin" make-model "$tmp/model" --preset tiny --seed 1 >/dev/null 2>"$tmp/mm.err" || { cat "$tmp/mm.err"; exit 1; }

# start NAME ARGS...: a server on a free port; sets URL_NAME from its log line.
start() {
  local name=$1; shift
  serve_start "$name" --log-level info "$@"
}

start main --served-model-name tiny tiny-alias
start auth --served-model-name tiny --api-key test-key
start small --served-model-name tiny --num-gpu-blocks-override 16 --block-size 16 --max-model-len 256
start busy --served-model-name tiny --max-waiting 1 --max-num-seqs 1

export PD_URL_MAIN=$URL_main PD_URL_AUTH=$URL_auth PD_URL_SMALL=$URL_small PD_URL_BUSY=$URL_busy
export PD_MODEL_NAME=tiny PD_API_KEY=test-key
fail=0
node "$dir/run.js" "$@" || fail=1

# Clean shutdown: SIGTERM -> drain -> exit status 0.
kill -TERM "${pids[0]}"
if wait "${pids[0]}"; then echo "ok: SIGTERM exit 0"; else echo "FAIL: exit status $? after SIGTERM"; fail=1; fi
grep -q "stopped" "$tmp/main.log" || { echo "FAIL: no 'stopped' line"; fail=1; }
# Bad flags: exit 2 naming the flag.
"$bin" serve "$tmp/model" --no-such-flag 1 >/dev/null 2>"$tmp/flag.err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--no-such-flag" "$tmp/flag.err" || { echo "FAIL: unknown flag (rc $rc): $(cat "$tmp/flag.err")"; fail=1; }
maxpos=$(node -e 'console.log(require(process.argv[1]).max_position_embeddings)' "$tmp/model/config.json")
"$bin" serve "$tmp/model" --max-model-len 100000 >/dev/null 2>"$tmp/mml.err"; rc=$?
[ $rc -eq 2 ] && grep -q "100000" "$tmp/mml.err" && grep -q "$maxpos" "$tmp/mml.err" || { echo "FAIL: --max-model-len too big (rc $rc): $(cat "$tmp/mml.err")"; fail=1; }
"$bin" serve "$tmp/model" --kv-transfer-config '{"kv_connector":"P2pNcclConnector","kv_role":"nope"}' >/dev/null 2>"$tmp/kv.err"; rc=$?
[ $rc -eq 2 ] && grep -q "kv_role" "$tmp/kv.err" || { echo "FAIL: bad --kv-transfer-config (rc $rc): $(cat "$tmp/kv.err")"; fail=1; }
if [ $fail -ne 0 ]; then
  for n in main auth small busy; do echo "--- $n log (tail)"; tail -5 "$tmp/$n.log"; done
fi
exit $fail
