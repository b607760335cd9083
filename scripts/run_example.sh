#!/usr/bin/env bash
# The main job: installs dependencies, builds, starts the hello_tensor server
# and runs the client against it. The client prints, per call, the transport
# that carried it and why.
#
#   scripts/run_example.sh [--vm] [CLIENT ARGS...]
#
# --vm then runs scripts/example_in_vm.sh where RDMA exists (natively with
# an ACTIVE RDMA port, else in the soft-RoCE VM, which takes a minute or
# two to boot here): calls over RDMA, a fallback to gRPC when the RDMA
# device is deleted, and the return to RDMA when it is back.
set -euo pipefail
cd "$(dirname "$0")/.."
vm=0
if [ "${1:-}" = "--vm" ]; then
  vm=1
  shift
fi
scripts/install_deps.sh
scripts/build.sh
build_dir="${BUILD_DIR:-build}"
bin="$build_dir/examples/hello_tensor"

port_file=$(mktemp)
rm -f "$port_file"
"$bin/hello_tensor_server" --port=0 --port-file="$port_file" &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$port_file"' EXIT
for _ in $(seq 1 100); do
  [ -s "$port_file" ] && break
  kill -0 $server 2>/dev/null || { echo "run_example: server exited" >&2; exit 1; }
  sleep 0.1
done
[ -s "$port_file" ] || { echo "run_example: server did not report its port" >&2; exit 1; }
port=$(cat "$port_file")
"$bin/hello_tensor_client" --target="localhost:$port" "$@"
if [ "$vm" = 1 ]; then
  kill $server 2>/dev/null || true
  wait $server 2>/dev/null || true
  echo "== run_example: the same example where RDMA exists (tests/rdma_vm/run.sh)"
  tests/rdma_vm/run.sh scripts/example_in_vm.sh "$build_dir"
fi
