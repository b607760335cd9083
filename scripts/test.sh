#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, runs every CTest test.
#
# Tests labelled rdma need an RDMA device: they run in one soft-RoCE VM boot
# (tests/rdma_vm/run.sh; natively where the machine has an ACTIVE RDMA port).
# Extra arguments go to a single ctest run instead (for example -L grpc);
# rdma tests picked that way boot a VM each.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
start=$(date +%s)
scripts/install_deps.sh
scripts/build.sh
build_dir="${BUILD_DIR:-build}"
cd "$build_dir"
if [ $# -gt 0 ]; then
  ctest --output-on-failure -j 2 "$@"
  echo "test.sh: done in $(($(date +%s) - start)) s"
  exit 0
fi

status=0
# The 3 GiB test runs alone (RUN_SERIAL); the rest two at a time.
ctest --output-on-failure -j 2 -LE '^rdma$' || status=1
echo "test.sh: host tests done at $(($(date +%s) - start)) s; now the rdma group"
rdma_start=$(date +%s)
RDMARPC_VM_VERBOSE=1 "$root/tests/rdma_vm/run.sh" \
  ctest --output-on-failure -L '^rdma$' || status=1
echo "test.sh: rdma group took $(($(date +%s) - rdma_start)) s (VM boot included)"
echo "test.sh: done in $(($(date +%s) - start)) s"
exit "$status"
