#include <cuda_runtime.h>

#include "stream_kernels.h"

namespace rdmarpc_test {
namespace {

__global__ void SlowFill(uint8_t* data, size_t n, uint8_t value,
                         long long spin_cycles) {
  // Each block's first thread spins; the block writes only after it.
  if (threadIdx.x == 0) {
    long long start = clock64();
    while (clock64() - start < spin_cycles) {
    }
  }
  __syncthreads();
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    data[i] = value;
  }
}

__global__ void CountMismatches(const uint8_t* data, size_t n, uint8_t value,
                                unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    local += data[i] != value;
  }
  if (local != 0) atomicAdd(mismatches, local);
}

}  // namespace

void LaunchSlowFill(void* stream, uint8_t* data, size_t n, uint8_t value,
                    int spin_ms) {
  int khz = 0;
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  long long cycles = static_cast<long long>(khz) * spin_ms;
  SlowFill<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(data, n, value,
                                                               cycles);
}

void LaunchCountMismatches(void* stream, const uint8_t* data, size_t n,
                           uint8_t value, unsigned long long* mismatches) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaMemsetAsync(mismatches, 0, sizeof(*mismatches), s);
  CountMismatches<<<64, 256, 0, s>>>(data, n, value, mismatches);
}

}  // namespace rdmarpc_test
