#!/usr/bin/env bash
# The benchmark suite, one command: installs what it needs, builds, runs
# every experiment beside its reference, and writes a results folder:
#   <out>/<experiment>.csv   one row per result: experiment, system, param,
#                            metric, value, unit, machine, rdma, command
#   <out>/summary.md         the tables, ratios and targets
#   <out>/*.png              plots
#
#   bench/run_all.sh [out]   (default bench/results/<date>)
#
# gRPC experiments run on this machine over loopback; RDMA experiments and
# perftest run in one boot of the soft-RoCE VM (natively where an RDMA port
# is ACTIVE). RDMARPC_BENCH_QUICK=1 runs fewer points (a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/$(date +%Y-%m-%d)}"
bash scripts/install_deps.sh
bash scripts/build.sh >/dev/null
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export RDMARPC_BENCH_OUT="$out"
RDMARPC_BENCH_MACHINE="$(nproc) cores, $(awk '/MemTotal/ {printf "%d GiB", $2 / 1048576}' /proc/meminfo), $(uname -r)"
export RDMARPC_BENCH_MACHINE
start=$SECONDS

# gRPC fallback vs stock gRPC, on this machine.
bash bench/experiments.sh grpc
# RDMA vs perftest, in one VM boot (or natively on real RDMA). The boot
# runs for about half an hour, past the harness's default limit for a hung
# guest.
RDMARPC_VM_TIMEOUT="${RDMARPC_VM_TIMEOUT:-5400}" \
  tests/rdma_vm/run.sh env RDMARPC_BENCH_OUT="$out" \
  RDMARPC_BENCH_MACHINE="$RDMARPC_BENCH_MACHINE" \
  RDMARPC_BENCH_QUICK="${RDMARPC_BENCH_QUICK:-}" bash bench/experiments.sh rdma

/usr/bin/python3 bench/report.py "$out"  # Debian's, with python3-matplotlib
echo "bench: done in $((SECONDS - start)) s; results in $out (summary.md)"
