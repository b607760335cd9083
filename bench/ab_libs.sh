#!/usr/bin/env bash
# Small RDMA calls with two builds of the library taking turns in one boot,
# so that a change reads against the same VM and the same moment: each
# folder holds a build's librdmarpc.so.0 and rpc_bench. Run where an RDMA
# device is (here: inside the soft-RoCE VM):
#
#   git stash && cmake --build build --target rdmarpc rpc_bench &&
#     mkdir -p /tmp/ab_old && cp -L build/runtime/librdmarpc.so.0 \
#     build/bench/rpc_bench /tmp/ab_old/ && git stash pop   # likewise new
#   tests/rdma_vm/run.sh bash bench/ab_libs.sh /tmp/ab_old /tmp/ab_new 4
#
# Per round and build, one line per row: p50 and p99 in us of 64 B calls
# (blocking and callback API in one process; blocking and chained with the
# server in its own process, and that server's user and system CPU over
# the run), system calls, futex calls and context switches per blocking
# round trip (both ends, `perf stat`, 3000 calls minus 1000), and the CPU
# of 32 idle connections.
set -uo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 DIR_A DIR_B [ROUNDS]" >&2; exit 2; }
dirs=("$1" "$2")
rounds="${3:-3}"

figures() {
  grep -E "p50|p99,|calls_per_s|cpu_percent" | cut -d, -f4,5 | tr '\n' ' '
}
# apart EXPERIMENT...: the server in its own process.
apart() {
  coproc SERVER { "$bench" serve rdma-inline; times > /tmp/ab_server_times; }
  local pid=$SERVER_PID to_server=${SERVER[1]} port
  read -r _ port <&"${SERVER[0]}"
  RDMARPC_BENCH_SERVER_PORT=$port "$bench" "$@" | figures
  # Its stdin closed, the server exits.
  exec {to_server}>&-
  wait "$pid"
  echo " server cpu: $(tail -1 /tmp/ab_server_times)"
}
counts() {
  local n ev x y line="per call:"
  for n in 1000 3000; do
    RDMARPC_BENCH_CALLS=$n perf stat -x, -o /tmp/ab_perf.$n \
      -e raw_syscalls:sys_enter,syscalls:sys_enter_futex,context-switches \
      "$bench" blocking rdma-inline 64 > /dev/null
  done
  for ev in raw_syscalls:sys_enter syscalls:sys_enter_futex context-switches; do
    x=$(awk -F, -v e="$ev" '$3 == e {print $1}' /tmp/ab_perf.1000)
    y=$(awk -F, -v e="$ev" '$3 == e {print $1}' /tmp/ab_perf.3000)
    line="$line ${ev##*:} $(echo "($y - $x) / 2000" | bc -l | cut -c1-5)"
  done
  echo "$line"
}

for ((r = 1; r <= rounds; r++)); do
  for dir in "${dirs[@]}"; do
    export LD_LIBRARY_PATH="$dir"
    bench="$dir/rpc_bench"
    echo "-- round $r: $dir"
    echo "one process, blocking: $("$bench" blocking rdma-inline 64 | figures)"
    echo "one process, callback: $("$bench" latency rdma-inline 64 | figures)"
    echo -n "apart, blocking: "
    apart blocking rdma-inline 64
    echo -n "apart, chained: "
    apart inflight rdma-inline 1
    counts
    echo "idle, 32 connections: $("$bench" idle rdma-inline 32 | figures)"
  done
done
