// CUDA: synchronous copies between host and GPU memory, through pinned
// chunks when the host side is pageable; each returns once the bytes are
// in place.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "runtime/cuda_internal.h"
#include "runtime/cuda_support.h"

namespace rdmarpc::internal {

namespace {

// A pageable host side: copy through two pinned chunks so that the CPU
// copy of one overlaps the DMA of the other.
Status CopyViaPinned(int gpu, void* dst, Device dst_device, const void* src,
                     size_t size) {
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream, ReceiveCopyStream(gpu));
  RDMARPC_ASSIGN_OR_RETURN(TensorBuffer bounce,
                           AllocatePinnedStaging(2 * kStagingChunk));
  UniqueEvent done[2];
  for (auto& e : done) {
    RDMARPC_ASSIGN_OR_RETURN(e, CreateEvent());
  }
  const bool to_device = dst_device.is_cuda();
  char* slots[2] = {static_cast<char*>(bounce.data()),
                    static_cast<char*>(bounce.data()) + kStagingChunk};
  size_t offsets[2] = {0, 0};
  size_t lengths[2] = {0, 0};
  bool busy[2] = {false, false};
  Status status;
  auto drain = [&](int k) -> Status {
    if (!busy[k]) return absl::OkStatus();
    busy[k] = false;
    cudaError_t err = cudaEventSynchronize(done[k].get());
    if (err != cudaSuccess) return CudaError("cudaEventSynchronize", err);
    if (!to_device) {
      std::memcpy(static_cast<char*>(dst) + offsets[k], slots[k], lengths[k]);
    }
    return absl::OkStatus();
  };
  for (size_t offset = 0, k = 0; offset < size && status.ok();
       offset += kStagingChunk, k ^= 1) {
    status = drain(static_cast<int>(k));
    if (!status.ok()) break;
    size_t n = std::min(kStagingChunk, size - offset);
    cudaError_t err;
    if (to_device) {
      std::memcpy(slots[k], static_cast<const char*>(src) + offset, n);
      err = cudaMemcpyAsync(static_cast<char*>(dst) + offset, slots[k], n,
                            cudaMemcpyDefault, stream);
    } else {
      err = cudaMemcpyAsync(slots[k], static_cast<const char*>(src) + offset, n,
                            cudaMemcpyDefault, stream);
    }
    if (err == cudaSuccess) err = cudaEventRecord(done[k].get(), stream);
    if (err != cudaSuccess) {
      status = CudaError("cudaMemcpyAsync", err);
      break;
    }
    offsets[k] = offset;
    lengths[k] = n;
    busy[k] = true;
  }
  for (int k = 0; k < 2; ++k) {
    Status drained = drain(k);
    if (status.ok()) status = drained;
  }
  return status;
}

}  // namespace

Status CudaCopy(void* dst, Device dst_device, const void* src,
                Device src_device, size_t size) {
  const Device& gpu = dst_device.is_cuda() ? dst_device : src_device;
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu.index));
  const void* host = dst_device.is_host()   ? dst
                     : src_device.is_host() ? src
                                            : nullptr;
  if (host != nullptr && size > kStagingChunk && !CudaIsPinnedHost(host)) {
    Status staged = CopyViaPinned(gpu.index, dst, dst_device, src, size);
    if (staged.code() != StatusCode::kResourceExhausted) return staged;
    // No pinned memory to spare: let CUDA stage it.
  }
  // On the legacy default stream, as cudaMemcpy, but waited for with an
  // event: cudaMemcpy from pageable memory returns before its DMA to the
  // GPU is done, and work on a non-blocking stream is not ordered after it.
  // cudaMemcpyDefault: unified addressing tells the direction, including
  // device to device across GPUs.
  RDMARPC_ASSIGN_OR_RETURN(UniqueEvent done, CreateEvent());
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, cudaStreamLegacy));
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaEventRecord(done.get(), cudaStreamLegacy));
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done.get()));
  return absl::OkStatus();
}

}  // namespace rdmarpc::internal
