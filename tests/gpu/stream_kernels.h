// Kernels the GPU tests launch to produce and consume tensors on a stream.
#ifndef RDMARPC_TESTS_GPU_STREAM_KERNELS_H_
#define RDMARPC_TESTS_GPU_STREAM_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace rdmarpc_test {

// Queues on `stream` (a cudaStream_t): spin for about `spin_ms`
// milliseconds, then set every byte of [data, data + n) to `value`. The
// spin makes a reader that ignores the stream see the old bytes.
void LaunchSlowFill(void* stream, uint8_t* data, size_t n, uint8_t value,
                    int spin_ms);

// Queues on `stream`: *mismatches = number of bytes of [data, data + n)
// that differ from `value` (*mismatches is zeroed first).
void LaunchCountMismatches(void* stream, const uint8_t* data, size_t n,
                           uint8_t value, unsigned long long* mismatches);

}  // namespace rdmarpc_test

#endif  // RDMARPC_TESTS_GPU_STREAM_KERNELS_H_
