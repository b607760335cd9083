#!/usr/bin/env bash
# One group of bench/run_all.sh's experiments: `grpc` (rdmarpc's gRPC
# fallback and stock gRPC, loopback) or `rdma` (rdmarpc over RDMA, perftest,
# the micro-benchmarks; run where an RDMA device is). Appends CSV files to
# $RDMARPC_BENCH_OUT and prints a progress line per experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
group="$1"
out="${RDMARPC_BENCH_OUT:?set by bench/run_all.sh}"
machine="${RDMARPC_BENCH_MACHINE:-unknown}"
bin="${BUILD_DIR:-build}/bench"
quick="${RDMARPC_BENCH_QUICK:-}"

rdma_kind="none"
if [[ "$group" == rdma ]]; then
  dev=$(ibv_devices | awk 'NR > 2 {print $1; exit}')
  rdma_kind="hardware ($dev)"
  if [[ "$dev" == rxe* ]]; then
    rdma_kind="soft-RoCE ($dev)"
    grep -q hypervisor /proc/cpuinfo && rdma_kind="soft-RoCE in a VM ($dev)"
  fi
fi

step=0
# run NAME COMMAND...: the command prints "experiment,system,param,metric,
# value,unit" rows; they go to NAME.csv with the machine, RDMA kind and the
# exact command appended.
run() {
  local name="$1"
  shift
  step=$((step + 1))
  local t0=$SECONDS
  local csv="$out/$name.csv"
  [[ -s "$csv" ]] || echo "experiment,system,param,metric,value,unit,machine,rdma,command" >"$csv"
  echo "bench: [$group $step] $name: $* ..." >&2
  local command="${COMMAND_TEXT:-$*}"
  "$@" | while IFS= read -r row; do
    echo "$row,\"$machine\",\"$rdma_kind\",\"$command\""
  done >>"$csv"
  echo "bench: [$group $step] $name done in $((SECONDS - t0)) s" >&2
}

small="64 256 1024 4096"
if [[ -n "$quick" ]]; then
  big_grpc="4096 1048576 67108864"
  big_rdma="4096 1048576 67108864"
  depths="1 8 64"
  conns="1 8 32"
  fans="1 4 8"
else
  big_grpc="4096 65536 1048576 16777216 67108864 268435456 1073741824"
  big_rdma="4096 65536 1048576 16777216 67108864 268435456"
  depths="1 2 4 8 16 32 64"
  conns="1 2 4 8 16 32"
  fans="1 2 4 8"
fi

# Small calls: 3 rounds in which the systems take turns; the summary takes
# the median of each row, so a slow moment of the machine hits one round of
# one system, not the ratio.
small_calls() {
  local round style sys
  for round in 1 2 3; do
    for style in latency blocking; do
      for sys in "$@"; do
        run "$style" "$bin/rpc_bench" "$style" "$sys" $small
      done
    done
  done
}

if [[ "$group" == grpc ]]; then
  small_calls grpc grpc-inline stock
  for sys in grpc stock; do
    run throughput "$bin/rpc_bench" throughput "$sys" $big_grpc
    run inflight "$bin/rpc_bench" inflight "$sys" $depths
    run connections "$bin/rpc_bench" connections "$sys" $conns
    run fanout "$bin/rpc_bench" fanout "$sys" $fans
  done
  exit 0
fi

addr="${RDMARPC_RDMA_ADDR:-$(ip -4 -o addr show | awk '$2 != "lo" {split($4, a, "/"); print a[1]; exit}')}"
# perftest_rows TOOL SIZE: one row from perftest's result line.
perftest() {
  local tool="$1" size="$2"
  "$tool" -d "$dev" -R -s "$size" -n "$3" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  "$tool" -d "$dev" -R -s "$size" -n "$3" "$addr" 2>/dev/null |
    awk -v tool="$tool" -v size="$size" '
      $1 == size && tool == "ib_send_lat" {
        print "perftest,ib_send_lat," size ",t_typical," $5 ",us" }
      $1 == size && tool == "ib_write_bw" {
        print "perftest,ib_write_bw," size ",bw_average," $4 ",MB/s" }'
  wait "$server" || true
}
perftest_all() {
  for s in $small; do perftest ib_send_lat "$s" 2000; done
  for s in $big_rdma; do
    n=20
    [[ "$s" -ge 67108864 ]] && n=5
    perftest ib_write_bw "$s" "$n"
  done
}
COMMAND_TEXT="ib_send_lat -d $dev -R -s SIZE -n 2000 [$addr]; ib_write_bw -d $dev -R -s SIZE -n 20 (5 from 64 MiB) [$addr]" \
  run perftest perftest_all
# The 64 MiB target: rdmarpc and ib_write_bw take turns, 3 rounds, and the
# summary compares their medians (soft-RoCE's bandwidth drifts from run to
# run by more than the margin the target leaves).
target64() {
  local round
  for round in 1 2 3; do
    perftest ib_write_bw 67108864 5 |
      sed "s/^perftest,ib_write_bw,67108864,bw_average,/target64,ib_write_bw,$round,throughput,/"
    "$bin/rpc_bench" throughput rdma 67108864 |
      awk -F, -v round="$round" '$4 == "throughput" {
        print "target64,rdma," round ",throughput," $5 "," $6 }'
  done
}
COMMAND_TEXT="3 rounds of: ib_write_bw -d $dev -R -s 67108864 -n 5 [$addr]; $bin/rpc_bench throughput rdma 67108864" \
  run target64 target64
small_calls rdma rdma-inline
run throughput "$bin/rpc_bench" throughput rdma $big_rdma
run inflight "$bin/rpc_bench" inflight rdma $depths
run connections "$bin/rpc_bench" connections rdma $conns
run fanout "$bin/rpc_bench" fanout rdma $fans
run threshold "$bin/rpc_bench" threshold rdma 256 1024 4096 8192 16384 24576
micro() {
  "$bin/micro_bench" --benchmark_format=csv 2>/dev/null |
    awk -F, 'NR > 1 && $1 ~ /^"BM_/ {
      gsub(/"/, "", $1); split($1, a, "/");
      print "micro," a[1] "," a[2] ",cpu_time," $4 "," $5 }'
}
run micro micro
