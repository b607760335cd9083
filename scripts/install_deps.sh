#!/usr/bin/env bash
# Installs rdmarpc's build and test dependencies from Debian 12 packages.
# Needs root (or sudo). Safe to run again: apt-get skips what is installed.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libprotobuf-dev libprotoc-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  # tests/interop: health.proto and reflection.proto for the python client.
  grpc-proto
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libibverbs-dev librdmacm-dev
  python3 python3-grpcio python3-protobuf
  # The sanitizer trees and libFuzzer (scripts/test.sh).
  clang-14 libclang-rt-14-dev
  # bench/run_all.sh: plots.
  python3-matplotlib linux-perf valgrind
  # tests/rdma_vm/dump_hung_tests.sh: stacks of a test that hangs.
  gdb procps
  # The soft-RoCE VM (tests/rdma_vm) and the RDMA smoke checks inside it.
  qemu-system-x86 busybox-static cpio kmod iproute2 xz-utils
  rdma-core ibverbs-utils ibverbs-providers rdmacm-utils perftest
  # tests/e2e/test_pki.h: TLS certificates made at test time.
  openssl
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    sudo="sudo"
  else
    echo "install_deps: missing packages (${missing[*]}) and not root; run as root" >&2
    exit 1
  fi
fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
