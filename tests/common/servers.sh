# servers.sh: shell helpers shared by the end-to-end tests (tests/server,
# tests/proxy, tests/connector) that start real pdserve processes. Source it
# after setting `bin` (the pdserve program) and `src` (the source tree).
#
#   servers_init [SIGNAL]   make $tmp and the pids array; at exit, kill every
#                           pid in pids (with SIGNAL, default TERM) and remove $tmp
#   servers_need_node       fail unless node and npm exist; install the
#                           `openai` package into tests/server/node_modules if missing
#   serve_start NAME ARGS   `pdserve serve $tmp/model` on a free port with ARGS
#                           (and $PDSERVE_SERVE_ARGS, e.g. "--device cuda" on the GPU machine);
#                           waits for its "on http://" log line and sets
#                           URL_NAME and PID_NAME (log in $tmp/NAME.log)
#   free_ports N            print N distinct free TCP ports on 127.0.0.1

servers_init() {
  servers_kill_signal=${1:-TERM}
  tmp=$(mktemp -d)
  pids=()
  trap servers_cleanup EXIT
}

servers_cleanup() {
  for p in "${pids[@]}"; do kill -"$servers_kill_signal" "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$tmp"
}

servers_need_node() {
  if ! command -v node >/dev/null; then
    echo "FAIL: node not installed (scripts/setup-deps.sh installs it)"; exit 1
  fi
  if [ ! -d "$src/tests/server/node_modules/openai" ]; then
    (cd "$src/tests/server" && npm install --no-audit --no-fund --no-package-lock --silent) || { echo "FAIL: npm install"; exit 1; }
  fi
}

serve_start() {
  local name=$1; shift
  "$bin" serve "$tmp/model" --host 127.0.0.1 --port 0 "$@" ${PDSERVE_SERVE_ARGS:-} >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  printf -v "PID_$name" '%s' "$!"
  local port=""
  for _ in $(seq 1 300); do
    port=$(sed -n 's/.* on http:\/\/[^:]*:\([0-9]*\) .*/\1/p' "$tmp/$name.log" | head -1)
    [ -n "$port" ] && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$port" ]; then echo "FAIL: server $name did not start:"; cat "$tmp/$name.log"; exit 1; fi
  printf -v "URL_$name" 'http://127.0.0.1:%s' "$port"
}

# Random ports below the kernel's ephemeral range (which starts at 32768
# on Linux), each bound once to check it is free: a port the kernel handed
# out here and then released can go to another test's client socket or
# listener before our server binds it (ctest runs tests side by side), and
# a request then reaches the wrong server. The sockets stay bound until
# all are picked, so the ports are distinct.
free_ports() {
  python3 -c '
import random, socket, sys
n, ss = int(sys.argv[1]), []
while len(ss) < n:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(10000, 32000)))
        ss.append(s)
    except OSError:
        s.close()
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}
