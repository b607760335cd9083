#!/usr/bin/env bash
# The RDMA transport beside perftest, in one boot of the soft-RoCE VM (or
# natively on real RDMA): small-call round trip against 2 x ib_send_lat,
# 64 MiB tensor throughput against ib_write_bw, and the inline-threshold
# sweep. Usage: bench/rdma_vs_perftest.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
if [[ -z "${RDMARPC_IN_VM:-}" && -z "${RDMARPC_RDMA_ADDR:-}" ]]; then
  exec tests/rdma_vm/run.sh env RDMARPC_IN_VM=1 "$0" "$build"
fi
addr="${RDMARPC_RDMA_ADDR:?the harness sets RDMARPC_RDMA_ADDR}"
dev=$(ibv_devices | awk 'NR > 2 {print $1; exit}')
echo "== perftest on $dev ($addr)"
ib_send_lat -d "$dev" -R -s 2 -n 2000 >/tmp/lat_server.txt 2>&1 &
sleep 1
ib_send_lat -d "$dev" -R -s 2 -n 2000 "$addr" | tee /tmp/lat.txt | tail -3
wait
ib_write_bw -d "$dev" -R -s $((64 << 20)) -n 20 >/tmp/bw_server.txt 2>&1 &
sleep 1
ib_write_bw -d "$dev" -R -s $((64 << 20)) -n 20 "$addr" | tail -3
wait
echo "== rdmarpc"
"$build/bench/rdma_calls" latency 0 64 4096
"$build/bench/rdma_calls" throughput 64 8
"$build/bench/rdma_calls" threshold
