// CUDA access for the runtime, detected at run time: device checks,
// allocation, pinned staging memory, ordered copies on a runtime stream per
// GPU, and the driver calls that GPU registration for RDMA needs.
//
// Built with CUDA (RDMARPC_HAVE_CUDA) it uses the statically linked CUDA
// runtime, which works on a machine without a driver or GPU (every call then
// reports UNAVAILABLE); built without CUDA every call reports that. Driver
// API functions come through cudaGetDriverEntryPointByVersion, so the
// library never links libcuda.
//
//   // Copy a device tensor to pinned host memory in chunks, after the work
//   // the producer queued on `stream`, and act on each chunk as it lands:
//   RDMARPC_ASSIGN_OR_RETURN(auto fence, CudaRecordFence(0, stream));
//   int queued = 0;
//   RDMARPC_RETURN_IF_ERROR(CudaCopyInChunks(
//       0, fence.get(), pinned, src, n, kChunk,
//       [](size_t offset, size_t len) { /* no CUDA calls here */ },
//       &queued));
#ifndef RDMARPC_RUNTIME_CUDA_SUPPORT_H_
#define RDMARPC_RUNTIME_CUDA_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"

namespace rdmarpc::internal {

int CudaDeviceCountCached();
Status CudaCheckDevice(int index);
StatusOr<TensorBuffer> CudaAllocate(size_t size, int index);
// At least one side is a CUDA device. Synchronous; a pageable host side
// goes through pinned staging buffers in pipelined chunks.
Status CudaCopy(void* dst, Device dst_device, const void* src,
                Device src_device, size_t size);

// Pinned (page-locked) host memory from a process-wide pool that grows in
// regions up to RDMARPC_CUDA_STAGING_BYTES (default 4 GiB) and never
// returns memory to CUDA: releasing a buffer is bookkeeping only, so a
// buffer may be released from a CUDA host function. RESOURCE_EXHAUSTED when
// the pool is at its limit, UNAVAILABLE without CUDA.
StatusOr<TensorBuffer> AllocatePinnedStaging(size_t size);

// Landing memory on GPU `gpu`: from a per-GPU pool of
// RDMARPC_CUDA_LANDING_POOL_BYTES (default 1 GiB, created on first use),
// or its own cudaMalloc when the pool cannot serve it.
StatusOr<TensorBuffer> AllocateGpuLanding(int gpu, size_t size);

// Queues the zeroing of GPU memory `buffer` on its GPU's clear stream (its
// own, so it waits for no copy); CudaWaitForClears(gpu) returns once every
// clear queued on `gpu` so far is done. Landing memory is cleared before a
// peer may write it: a peer that writes less than its grant must not leave
// the reader what an earlier call put there.
[[nodiscard]] Status CudaQueueClear(const TensorBuffer& buffer);
[[nodiscard]] Status CudaWaitForClears(int gpu);

// Whether `ptr` lies in host memory CUDA has pinned (cudaHostAlloc or
// cudaHostRegister).
bool CudaIsPinnedHost(const void* ptr);

// A point in a CUDA stream's work: an event recorded on it.
class CudaFence {
 public:
  virtual ~CudaFence() = default;
  // Blocks until the work before the fence is done (not a device sync).
  [[nodiscard]] virtual Status Wait() = 0;
};

// Records a fence on `stream` (a cudaStream_t, on whatever device it
// belongs to; nullptr is the legacy default stream of GPU `gpu`).
StatusOr<std::shared_ptr<CudaFence>> CudaRecordFence(int gpu, void* stream);

// Copies `size` bytes on GPU `gpu`'s send copy stream, after `after` (may
// be null), in chunks of `chunk` bytes; `on_chunk(offset, length)` runs on
// CUDA's host-function thread once each chunk is in place, in order.
// `on_chunk` must not call CUDA. Returns once the work is queued, with
// *queued the number of `on_chunk` calls queued (also on an error); the
// memory must stay valid until the last of them has run.
[[nodiscard]] Status CudaCopyInChunks(
    int gpu, const CudaFence* after, void* dst, const void* src, size_t size,
    size_t chunk, std::function<void(size_t, size_t)> on_chunk, int* queued);

// Runs `fn` on CUDA's host-function thread after `after` (which must not be
// null), in order with CudaCopyInChunks on the same GPU. `fn` must not call
// CUDA.
[[nodiscard]] Status CudaThen(int gpu, const CudaFence* after,
                              std::function<void()> fn);

// Copies bytes that have landed (for example by RDMA, in pinned memory) to
// their place on a GPU, on the receive copy stream (never queued behind a
// send's wait for its producer). With `consumer` set,
// work queued on that stream afterwards is ordered after the copy and the
// function returns at once (`keep` is released when the copy is done);
// otherwise it returns once the copy is done.
struct ConsumerStream {
  void* stream = nullptr;  // a cudaStream_t
};
[[nodiscard]] Status CudaCopyOrdered(void* dst, Device dst_device,
                                     const void* src, Device src_device,
                                     size_t size,
                                     const ConsumerStream* consumer,
                                     TensorBuffer keep);

// Driver API pieces for registering GPU memory with an RDMA device.
//
// Whether GPU `gpu` can export memory as a dma-buf
// (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED); FAILED_PRECONDITION saying why
// not.
[[nodiscard]] Status CudaDmaBufSupported(int gpu);

// A dma-buf file descriptor for the whole allocation holding
// [ptr, ptr + size) (cuMemGetAddressRange, then
// cuMemGetHandleForAddressRange over whole host pages), and where `ptr`
// lies in it. The caller closes `fd`.
struct DmaBufRange {
  int fd = -1;
  uint64_t offset = 0;  // of ptr from the exported range's start
};
StatusOr<DmaBufRange> CudaExportDmaBuf(const void* ptr, size_t size);

// Makes CUDA's own copies to and from `ptr`'s allocation synchronous with
// respect to a NIC reading or writing it (CU_POINTER_ATTRIBUTE_SYNC_MEMOPS),
// as peer-memory registration needs.
[[nodiscard]] Status CudaSetSyncMemops(const void* ptr);

// Makes RDMA writes that landed in GPU `gpu`'s memory visible to its
// kernels, where the device does not order them itself
// (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING below OWNER):
// cuFlushGPUDirectRDMAWrites.
[[nodiscard]] Status CudaFlushRdmaWrites(int gpu);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_CUDA_SUPPORT_H_
