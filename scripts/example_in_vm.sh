#!/usr/bin/env bash
# The hello_tensor example where RDMA exists: inside the soft-RoCE VM
# (tests/rdma_vm/run.sh, which run_example.sh --vm boots), or natively on
# a host with an ACTIVE rxe0. One client channel makes three rounds of
# calls: over RDMA; with rxe0 deleted, so the channel falls back to gRPC
# and says why; with rxe0 back, so its probe returns it to RDMA.
#
#   scripts/example_in_vm.sh BUILD_DIR
set -euo pipefail
bin="$1/examples/hello_tensor"
# The rxe device's netdev, to re-create it after the deletion.
netdev=$(rdma link show rxe0/1 | sed -n 's/.* netdev \([^ ]*\).*/\1/p')
[ -n "$netdev" ] || { echo "example_in_vm: no rxe0 device here" >&2; exit 1; }
# /dev/shm: the VM mounts the host tree over 9p, which has no FIFOs.
work=$(mktemp -d -p /dev/shm)
# A spare rxe device that stays: librdmacm lets go of a removed device only
# when it re-reads a device list that is not empty, and 'rdma link delete'
# waits for every process to let go (docs/design.md, "Soft-RoCE limits").
if [ ! -e /sys/class/infiniband/rxe_spare ]; then
  ip link add rxe_spare_nd type dummy
  ip link set rxe_spare_nd up
  rdma link add rxe_spare type rxe netdev rxe_spare_nd
fi
cleanup() {
  kill "${server:-}" "${client:-}" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$bin/hello_tensor_server" --port=0 --port-file="$work/port" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 100); do
  [ -s "$work/port" ] && break
  sleep 0.1
done
[ -s "$work/port" ] || { echo "example_in_vm: server did not start" >&2; cat "$work/server.log" >&2; exit 1; }

# The client reads a line before rounds 2 and 3 (--wait-between-rounds);
# the script answers once the round before has printed its last call.
mkfifo "$work/control"
"$bin/hello_tensor_client" --target="localhost:$(cat "$work/port")" \
  --rounds=3 --wait-between-rounds <"$work/control" >"$work/client.log" 2>&1 &
client=$!
exec 3>"$work/control"
shown=0
# Prints what the client wrote since the last call.
show_new() {
  local total
  total=$(wc -l <"$work/client.log")
  [ "$total" -gt "$shown" ] && sed -n "$((shown + 1)),${total}p" "$work/client.log"
  shown=$total
}
rounds_done() { grep -c '^call 4:' "$work/client.log" || true; }
# Waits for round $1's last call (or the client's exit), then shows it.
await_round() {
  while [ "$(rounds_done)" -lt "$1" ]; do
    kill -0 "$client" 2>/dev/null || break
    sleep 0.1
  done
  sleep 0.1  # the rest of the call's lines
  show_new
}

await_round 1
echo "== example_in_vm: 'rdma link delete rxe0': the RDMA device goes away"
rdma link delete rxe0
echo go >&3
await_round 2
echo "== example_in_vm: 'rdma link add rxe0 type rxe netdev $netdev': it is back"
rdma link add rxe0 type rxe netdev "$netdev"
echo await-rdma >&3
exec 3>&-
rc=0
wait "$client" || rc=$?
client=
show_new
exit "$rc"
