// What the CUDA files of the runtime share (cuda_device.cc, cuda_pinned.cc,
// cuda_streams.cc, cuda_copy.cc, cuda_driver.cc): CUDA errors as Status,
// RAII handles for streams and events, and the guard that leaves the
// calling thread's current device as it found it. Compiled only with CUDA;
// runtime/cuda_support.h is the interface the rest of the runtime uses.
//
//   DeviceGuard guard;
//   RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
//   RDMARPC_ASSIGN_OR_RETURN(UniqueEvent done, CreateEvent());
//   RDMARPC_CUDA_RETURN_IF_ERROR(cudaEventRecord(done.get(), stream));
#ifndef RDMARPC_RUNTIME_CUDA_INTERNAL_H_
#define RDMARPC_RUNTIME_CUDA_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "rdmarpc/status.h"

namespace rdmarpc::internal {

[[nodiscard]] Status CudaError(const char* what, cudaError_t err);

#define RDMARPC_CUDA_RETURN_IF_ERROR(call)       \
  do {                                           \
    cudaError_t rdmarpc_cuda_err = (call);       \
    if (rdmarpc_cuda_err != cudaSuccess) {       \
      return CudaError(#call, rdmarpc_cuda_err); \
    }                                            \
  } while (0)

// Restores the calling thread's current device: the runtime runs on user
// and handler threads and must not change theirs.
class DeviceGuard {
 public:
  DeviceGuard();
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Makes GPU `index` current after checking that it exists.
[[nodiscard]] Status UseDevice(int index);

// The copy stream for work that lands on `gpu`; makes `gpu` current.
[[nodiscard]] StatusOr<cudaStream_t> ReceiveCopyStream(int gpu);

// Staging copies and their writes go in chunks of this size, so that the
// copy of one chunk overlaps the write (or DMA) of the one before.
inline constexpr size_t kStagingChunk = size_t{4} << 20;

struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
// Destroyed with the current device being the one they were created on is
// not required: CUDA finds their context itself.
using UniqueEvent = std::unique_ptr<CUevent_st, EventDeleter>;
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;

// An event for ordering only (no timing), on the current device.
[[nodiscard]] StatusOr<UniqueEvent> CreateEvent();
// A stream that does not wait for the legacy default stream, on the current
// device.
[[nodiscard]] StatusOr<UniqueStream> CreateNonBlockingStream();

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_CUDA_INTERNAL_H_
