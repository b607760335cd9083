#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, runs every CTest test.
# Extra arguments go to ctest (for example -L grpc).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/install_deps.sh
scripts/build.sh
build_dir="${BUILD_DIR:-build}"
cd "$build_dir"
# The 3 GiB test runs alone (RUN_SERIAL); the rest two at a time.
ctest --output-on-failure -j 2 "$@"
echo "test.sh: done in $(( $(date +%s) - start )) s"
