#!/usr/bin/env bash
# Configures and builds rdmarpc into ${BUILD_DIR:-build}. Extra arguments go
# to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja "$@"
jobs=$(nproc)
cmake --build "$build_dir" -j "$jobs"
