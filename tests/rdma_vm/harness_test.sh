#!/usr/bin/env bash
# Tests of tests/rdma_vm/run.sh itself (label rdma_vm, runs on the host and
# boots its own VMs): the command's output and exit code come back, and the
# harness fails loudly (exit 125, a message saying why) when apt cannot name
# a kernel, when qemu is killed mid-run, and when the guest hangs.
set -uo pipefail

run="$(cd "$(dirname "$0")" && pwd)/run.sh"
failures=0
check() {  # check DESCRIPTION CONDITION...
  local what="$1"
  shift
  if "$@"; then
    echo "ok: $what"
  else
    echo "FAIL: $what"
    failures=$((failures + 1))
  fi
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export RDMARPC_RDMA_VM=always  # the VM path even on a machine with RDMA

# 1. Output and exit code pass through; the device is there, ACTIVE.
out="$("$run" bash -c 'echo "marker $(cat /sys/class/infiniband/rxe0/ports/1/state)"; exit 7' 2>&1)"
rc=$?
check "exit code 7 comes back (got $rc)" test "$rc" -eq 7
check "output comes back with rxe0 ACTIVE" grep -q "marker 4: ACTIVE" <<<"$out"

# 2. apt names no kernel and nothing is cached: a specific error, no boot.
mkdir -p "$work/apt/lists" "$work/empty-cache"
cat >"$work/apt.conf" <<EOF
Dir::State::Lists "$work/apt/lists";
Dir::Etc::SourceList "/dev/null";
Dir::Etc::SourceParts "$work/apt";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
out="$(APT_CONFIG="$work/apt.conf" RDMARPC_VM_CACHE="$work/empty-cache" "$run" true 2>&1)"
rc=$?
check "unresolvable kernel fails with 125 (got $rc)" test "$rc" -eq 125
check "unresolvable kernel says to run apt-get update" \
  grep -q "cannot resolve Debian's kernel package.*apt-get update" <<<"$out"

# 3. The kernel download fails (apt-get stands in for a dead mirror): the
#    apt output and what to check, no boot.
mkdir -p "$work/bin" "$work/empty-cache2"
printf '#!/bin/sh\necho "E: Failed to fetch http://deb.debian.org/...: 503"\nexit 100\n' \
  >"$work/bin/apt-get"
chmod +x "$work/bin/apt-get"
out="$(PATH="$work/bin:$PATH" RDMARPC_VM_CACHE="$work/empty-cache2" "$run" true 2>&1)"
rc=$?
check "failed kernel download fails with 125 (got $rc)" test "$rc" -eq 125
check "failed kernel download shows apt's error and what to check" \
  grep -q "downloading linux-image-.* with 'apt-get download' failed" <<<"$out"
check "apt's own message is shown" grep -q "Failed to fetch" <<<"$out"

# 4. qemu killed while the command runs: the run fails and says so.
mkdir -p "$work/kill"
(TMPDIR="$work/kill" "$run" bash -c 'echo started; sleep 600' >"$work/kill.out" 2>&1
  echo $? >"$work/kill.rc") &
for _ in $(seq 1 600); do
  grep -q started "$work/kill.out" 2>/dev/null && break
  sleep 0.2
done
check "guest command started before the kill" grep -q started "$work/kill.out"
pkill -KILL -f "qemu-system-x86_64.*rdmarpc.job=$work/kill/" || true
wait
rc="$(cat "$work/kill.rc")"
check "killed qemu fails the run with 125 (got $rc)" test "$rc" -eq 125
check "killed qemu is reported as such" \
  grep -q "qemu exited (status .*) before the command in the guest finished" "$work/kill.out"

# 5. A guest that hangs past RDMARPC_VM_TIMEOUT is killed and reported.
out="$(TMPDIR="$work" RDMARPC_VM_TIMEOUT=20 "$run" sleep 600 2>&1)"
rc=$?
check "hung guest fails the run with 125 (got $rc)" test "$rc" -eq 125
check "hung guest is reported as a timeout" \
  grep -q "guest timed out after 20 s" <<<"$out"

if [ "$failures" -ne 0 ]; then
  echo "harness_test: $failures check(s) failed"
  exit 1
fi
echo "harness_test: all checks passed"
