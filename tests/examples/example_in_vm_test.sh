#!/usr/bin/env bash
# scripts/example_in_vm.sh (the main job's --vm step) does what it shows:
# round 1 over RDMA, round 2 over gRPC because the device was removed,
# round 3 back over RDMA, every output checked. Label fault: it deletes and
# re-creates rxe0, so it runs where the fault tests run (in the VM, as root).
#
#   example_in_vm_test.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
src=$1
build=$2
if [ "$(id -u)" != 0 ] || [ ! -e /sys/class/infiniband/rxe0 ]; then
  echo "SKIPPED: needs root and the soft-RoCE device rxe0 (run in tests/rdma_vm/run.sh)"
  exit 0
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$src/scripts/example_in_vm.sh" "$build" >"$out" 2>&1
rc=$?
cat "$out"
fail() {
  echo "FAILED: $*"
  exit 1
}
[ "$rc" = 0 ] || fail "example_in_vm.sh exited with $rc"
grep -q '^12 calls, 0 failed$' "$out" || fail "not every call succeeded"
# Lines "transport: KIND, because ..." of round $1.
round() {
  awk -v r="round $1:" '/^round [0-9]+:/ { on = (index($0, r) == 1) } on && /^  transport:/' "$out"
}
expect_round() {
  local n=$1 want=$2 lines
  lines=$(round "$n")
  [ "$(grep -c . <<<"$lines")" = 4 ] || fail "round $n: $(grep -c . <<<"$lines") calls, want 4"
  [ "$(grep -c -- "$want" <<<"$lines")" = 4 ] || fail "round $n: want every call to say '$want', got:
$lines"
}
expect_round 1 "transport: rdma, because RDMA connection to"
expect_round 2 "transport: grpc, because .*device removed"
expect_round 3 "transport: rdma, because RDMA connection to"
grep -q '^round 2: channel: degraded' "$out" || fail "round 2 did not start degraded"
grep -q '^round 3: channel: rdma-ready' "$out" || fail "round 3 did not start on RDMA"
echo "ok: RDMA, then gRPC saying the device was removed, then RDMA again"
