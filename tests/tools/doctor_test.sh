#!/usr/bin/env bash
# `rdmarpc doctor` and `rdmarpc ping` on this machine.
#
#   doctor_test.sh RDMARPC HELLO_TENSOR_SERVER host|rdma
#
# host: whatever this machine has. Without an RDMA device the doctor must
#   say so with the soft-RoCE fix and exit 1, and ping must show calls over
#   grpc with the reason; with one, each device must be listed.
# rdma: on an ACTIVE RDMA port (natively or in the soft-RoCE VM, through
#   tests/rdma_vm/run.sh): the doctor must list the port, its GIDs and the
#   address, route to that address with rdma_cm and find no problem (the
#   VM runs as root: CAP_IPC_LOCK); ping with policy rdma must go over rdma
#   both ways.
set -uo pipefail

tool="$1" server="$2" mode="$3"
tmp="$(mktemp -d)"
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid"
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*"
  exit 1
}
# expect FILE TEXT: FILE holds TEXT (a fixed string).
expect() {
  grep -qF -- "$2" "$1" || fail "$(basename "$1") lacks '$2'"
}

"$tool" doctor > "$tmp/doctor" 2>&1
doctor_rc=$?
cat "$tmp/doctor"
for section in "RDMA devices" "RDMA address" "Locked memory" "GPUs" \
               "Verdict:"; do
  expect "$tmp/doctor" "$section"
done

devices=()
for d in /sys/class/infiniband/*; do
  [ -e "$d" ] && devices+=("$(basename "$d")")
done

if [ "$mode" = rdma ]; then
  [ "$doctor_rc" -eq 0 ] || fail "doctor exit $doctor_rc on an RDMA host, want 0"
  expect "$tmp/doctor" ": ACTIVE, link layer"
  expect "$tmp/doctor" "GID 0:"
  expect "$tmp/doctor" "No problems found."
  expect "$tmp/doctor" "take RDMA"
  addr="$(sed -n '/^RDMA address/{n;s/^  \([0-9.]*\):.*/\1/p}' "$tmp/doctor")"
  [ -n "$addr" ] || fail "doctor names no RDMA address"
  "$tool" doctor --peer="$addr" > "$tmp/peer" 2>&1 ||
    { cat "$tmp/peer"; fail "doctor --peer=$addr failed"; }
  expect "$tmp/peer" "rdma_cm routes to it through"
  echo "ok: doctor --peer=$addr: $(grep 'routes to it' "$tmp/peer")"
  # TEST-NET-1 (RFC 5737): no host answers there.
  "$tool" doctor --peer=192.0.2.1 > "$tmp/nowhere" 2>&1
  rc=$?
  [ $rc -eq 1 ] || { cat "$tmp/nowhere"; fail "doctor --peer=192.0.2.1: exit $rc, want 1"; }
  expect "$tmp/nowhere" "rdma_cm has no route to 192.0.2.1"
  echo "ok: $(grep 'no route' "$tmp/nowhere")"
else
  if [ ${#devices[@]} -eq 0 ]; then
    [ "$doctor_rc" -eq 1 ] || fail "doctor exit $doctor_rc without RDMA, want 1"
    expect "$tmp/doctor" "Fix: load the NIC's RDMA driver"
    expect "$tmp/doctor" "rdma link add rxe0 type rxe"
    expect "$tmp/doctor" "go over gRPC/TCP"
  else
    for d in "${devices[@]}"; do expect "$tmp/doctor" "  $d"; done
  fi
fi
echo "ok: doctor (exit $doctor_rc)"

# An 8 MiB locked-memory limit (Debian's default for users) is a problem
# with its fix. Root keeps CAP_IPC_LOCK unless setpriv drops it.
drop=()
if [ "$(id -u)" -eq 0 ]; then
  command -v setpriv > /dev/null && drop=(setpriv --bounding-set=-ipc_lock)
fi
if [ "$(id -u)" -ne 0 ] || [ ${#drop[@]} -gt 0 ]; then
  (ulimit -l 8192 && exec "${drop[@]}" "$tool" doctor) > "$tmp/memlock" 2>&1
  rc=$?
  [ $rc -eq 1 ] || { cat "$tmp/memlock"; fail "doctor under ulimit -l 8192: exit $rc, want 1"; }
  expect "$tmp/memlock" "limit 8 MiB: room for 2 RDMA connection(s)"
  expect "$tmp/memlock" "the locked-memory limit is 8 MiB"
  expect "$tmp/memlock" 'Fix: raise `ulimit -l`'
  echo "ok: doctor under ulimit -l 8192 names the limit and the fix"
else
  echo "skipped: the locked-memory check (root without setpriv)"
fi

"$server" --port=0 --port-file="$tmp/port" > "$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 300); do
  [ -s "$tmp/port" ] && grep -q '^[0-9]*$' "$tmp/port" && break
  sleep 0.1
done
port="$(cat "$tmp/port" 2>/dev/null)"
[ -n "$port" ] || { cat "$tmp/server.log"; fail "the server wrote no port"; }

policy=auto
[ "$mode" = rdma ] && policy=rdma
"$tool" ping "127.0.0.1:$port" --count=3 --size=100 --policy=$policy \
  > "$tmp/ping" 2>&1 || { cat "$tmp/ping"; fail "ping failed"; }
cat "$tmp/ping"
expect "$tmp/ping" "3 calls to 127.0.0.1:$port"
if [ "$mode" = rdma ]; then
  expect "$tmp/ping" "3 over rdma, 0 over grpc"
  expect "$tmp/ping" "server: received it over rdma; its RDMA: listening on"
elif [ ${#devices[@]} -eq 0 ]; then
  expect "$tmp/ping" "0 over rdma, 3 over grpc"
  expect "$tmp/ping" "because policy 'auto': this host has no usable RDMA device"
  expect "$tmp/ping" "server: received it over grpc; its RDMA: no RDMA:"
fi
echo "ok: ping"

# A port nobody listens on: the call fails, exit 1, with gRPC's reason.
kill "$server_pid" && wait "$server_pid"
server_pid=""
"$tool" ping "127.0.0.1:$port" --count=1 --policy=grpc > "$tmp/closed" 2>&1
rc=$?
cat "$tmp/closed"
[ $rc -eq 1 ] || fail "ping of a closed port: exit $rc, want 1"
expect "$tmp/closed" "failed: UNAVAILABLE"

"$tool" ping > "$tmp/usage" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "ping without a target: exit $rc, want 2"
expect "$tmp/usage" "give the server as HOST:PORT"
"$tool" ping "127.0.0.1:$port" --count=0 > "$tmp/usage" 2>&1
[ $? -eq 2 ] || fail "ping --count=0: want exit 2"
echo "PASS"
