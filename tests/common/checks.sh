# checks.sh: the counting helpers of the shell tests. Source it first;
# it makes a scratch directory $tmp (removed at exit) and counts checks.
#
#   ok                        count a passed check
#   bad MESSAGE               count a failed check and print why (stderr)
#   expect_rc RC WHAT CMD...  run CMD (stdout to $tmp/out, stderr to
#                             $tmp/err); a check that it exits with RC
#   checks_done [NOTE]        print the counts; exit status 0 only if none failed
#
# A test that starts servers uses tests/common/servers.sh for $tmp instead;
# then it sets checks_no_tmp=1 before sourcing this file.

if [ "${checks_no_tmp:-0}" != 1 ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
pass=0 fail=0

ok() { pass=$((pass + 1)); }
bad() {
  fail=$((fail + 1))
  echo "FAIL: $*" >&2
}
expect_rc() {
  local want=$1 what=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -eq "$want" ]; then ok; else bad "$what: exit $rc, wanted $want ($(head -c 400 "$tmp/err"))"; fi
}
checks_done() {
  echo "$pass passed, $fail failed${1:+ ($1)}"
  [ "$fail" -eq 0 ]
}
