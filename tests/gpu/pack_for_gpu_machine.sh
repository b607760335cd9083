#!/bin/bash
# Packs the GPU checks for a machine that has a GPU but not this machine's
# packages (the lent GPU machine has no Debian registry): the test and
# example binaries of build tree $1 (default build), every library they
# load but glibc's, and run.sh, into folder $2 (default .gpu-pack).
#
#   tests/gpu/pack_for_gpu_machine.sh build .gpu-pack
#   # there, from the repository root, with the folder carried:
#   OUT=/tmp/out bash .gpu-pack/run.sh
#
# run.sh runs cuda_support_test and gpu_payload_test (3 rounds each),
# hello_tensor with --device=cuda, and compute-sanitizer's memcheck and
# synccheck over both tests (gpu_payload_test's gRPC cases); logs go to
# $OUT.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
pack=${2:-.gpu-pack}
rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib"
for b in tests/gpu/gpu_payload_test tests/gpu/cuda_support_test examples/hello_tensor/hello_tensor_client \
  examples/hello_tensor/hello_tensor_server; do
  cp "$build/$b" "$pack/bin/"
done
for b in "$pack"/bin/*; do
  LD_LIBRARY_PATH="$build/runtime" ldd "$b" | awk '/=> \//{print $3}'
done | sort -u |
  grep -v -E '/(libc|libm|libgcc_s|libpthread|libdl|librt)\.so' |
  while read -r lib; do cp -L "$lib" "$pack/lib/"; done
strip --strip-debug "$pack"/bin/* "$pack"/lib/*
cat >"$pack/run.sh" <<'RUN'
#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib
B=$here/bin
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/all.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
echo "=== cuda_support_test, 3 rounds"
timeout 120 "$B/cuda_support_test" --gtest_repeat=3 2>&1 |
  tee "$OUT/cuda_support.log" | grep -E 'Failure|Which is|SKIPPED|FAILED|PASSED|^\[='
echo "rc ${PIPESTATUS[0]}"
echo "=== gpu_payload_test, 3 rounds"
timeout 240 "$B/gpu_payload_test" --gtest_repeat=3 2>&1 |
  tee "$OUT/gpu_payload.log" |
  grep -E 'forced|1 GiB|Failure|Which is|SKIPPED|FAILED|PASSED|^\[='
echo "rc ${PIPESTATUS[0]}"
echo "=== hello_tensor --device=cuda"
rm -f /tmp/hello_port
"$B/hello_tensor_server" --port=0 --port-file=/tmp/hello_port >/dev/null 2>&1 &
for _ in $(seq 50); do [ -s /tmp/hello_port ] && break; sleep 0.1; done
timeout 60 "$B/hello_tensor_client" --target="127.0.0.1:$(cat /tmp/hello_port)" \
  --device=cuda 2>&1 | grep -E '^call|calls|transport:'
echo "rc ${PIPESTATUS[0]}"
kill %1
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
cases='*DTypes*grpc:*SendWaits*grpc:*Staging*grpc:*EachRegistration*grpc:GpuLandingTest.*'
for tool in memcheck synccheck; do
  echo "=== compute-sanitizer $tool"
  timeout 150 "$cs" --tool $tool "$B/gpu_payload_test" --gtest_filter="$cases" \
    2>&1 | tee "$OUT/$tool.log" | tail -3
  timeout 100 "$cs" --tool $tool "$B/cuda_support_test" \
    2>&1 | tee "$OUT/$tool-support.log" | tail -3
done
RUN
du -sh "$pack"
