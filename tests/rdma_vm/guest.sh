#!/bin/bash
# PID 1 of the soft-RoCE VM, running from the host's tree over 9p (see
# run.sh). Brings up rxe0 on a dummy interface, then runs the job's command
# with the caller's environment and working directory, and powers off.
job="$1"
addr=198.18.0.1

fail() {
  echo "rdma_vm guest: $*"
  echo "$*" >"$job/harness_error"
  sync
  /bin/busybox poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run

ip link set lo up
ip link add rt0 type dummy || fail "cannot create the dummy interface rt0"
ip link set rt0 mtu 9000 up
ip addr add "$addr/24" dev rt0
rdma link add rxe0 type rxe netdev rt0 ||
  fail "'rdma link add rxe0 type rxe netdev rt0' failed (dmesg: $(dmesg | tail -n 3 | tr '\n' ' '))"
state=/sys/class/infiniband/rxe0/ports/1/state
for _ in $(seq 1 100); do
  grep -q ACTIVE "$state" 2>/dev/null && break
  sleep 0.1
done
grep -q ACTIVE "$state" 2>/dev/null ||
  fail "rxe0 port 1 did not become ACTIVE (state: $(cat "$state" 2>/dev/null))"
ulimit -l unlimited || fail "cannot raise the locked-memory limit"

cut -d' ' -f1 /proc/uptime >"$job/boot_s"
# shellcheck disable=SC1091
source "$job/env"
export RDMARPC_RDMA_ADDR="$addr"
export RDMARPC_RDMA_VM_GUEST=1  # tests that rewire the network run only here
cd "$(cat "$job/cwd")" || fail "working directory $(cat "$job/cwd") missing in the guest"

if [ -e "$job/shell" ]; then
  echo "rdma_vm: shell in the VM (rxe0 on $addr); 'exit' powers off"
  setsid -c bash -i </dev/ttyS0 >/dev/ttyS0 2>&1
  echo 0 >"$job/rc"
else
  eval "$(cat "$job/cmd")" >"$job/output" 2>&1 </dev/null
  echo $? >"$job/rc"
fi
sync
/bin/busybox poweroff -f
