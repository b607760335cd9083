#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, runs every CTest test.
#
# Tests labelled rdma and fault need an RDMA device: they run in one
# soft-RoCE VM boot (tests/rdma_vm/run.sh; natively where the machine has an
# ACTIVE RDMA port), the fault tests last since they delete and re-create
# the rxe link.
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
ctest --output-on-failure -j 2 -LE '^(rdma|fault)$' || status=1
echo "test.sh: host tests done at $(($(date +%s) - start)) s; now the rdma and fault groups"
rdma_start=$(date +%s)
# shellcheck disable=SC2016  # expanded in the VM
RDMARPC_VM_VERBOSE=1 "$root/tests/rdma_vm/run.sh" sh -c \
  'ctest --output-on-failure -L "^rdma$"; s=$?; ctest --output-on-failure -L "^fault$" || s=1; exit $s' ||
  status=1
echo "test.sh: rdma and fault groups took $(($(date +%s) - rdma_start)) s (VM boot included)"
echo "test.sh: done in $(($(date +%s) - start)) s"
exit "$status"
