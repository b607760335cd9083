// The CUDA entry points of cuda_support.h in a build without CUDA: no GPU,
// and each operation says the build has no CUDA.
#include <functional>
#include <memory>

#include "runtime/cuda_support.h"

namespace rdmarpc::internal {

namespace {
Status NotBuilt() {
  return absl::UnavailableError(
      "CUDA unavailable: rdmarpc was built without CUDA (no toolkit found at "
      "build time)");
}
}  // namespace

int CudaDeviceCountCached() { return 0; }
Status CudaCheckDevice(int) { return NotBuilt(); }
StatusOr<TensorBuffer> CudaAllocate(size_t, int) { return NotBuilt(); }
Status CudaCopy(void*, Device, const void*, Device, size_t) {
  return NotBuilt();
}
StatusOr<TensorBuffer> AllocatePinnedStaging(size_t) { return NotBuilt(); }
Status CudaQueueClear(const TensorBuffer&) { return NotBuilt(); }
Status CudaWaitForClears(int) { return NotBuilt(); }
bool CudaIsPinnedHost(const void*) { return false; }
StatusOr<std::shared_ptr<CudaFence>> CudaRecordFence(int, void*) {
  return NotBuilt();
}
Status CudaCopyInChunks(int, const CudaFence*, void*, const void*, size_t,
                        size_t, std::function<void(size_t, size_t)>,
                        int* queued) {
  *queued = 0;
  return NotBuilt();
}
Status CudaThen(int, const CudaFence*, std::function<void()>) {
  return NotBuilt();
}
Status CudaCopyOrdered(void*, Device, const void*, Device, size_t,
                       const ConsumerStream*, TensorBuffer) {
  return NotBuilt();
}
Status CudaDmaBufSupported(int) { return NotBuilt(); }
StatusOr<DmaBufRange> CudaExportDmaBuf(const void*, size_t) {
  return NotBuilt();
}
Status CudaSetSyncMemops(const void*) { return NotBuilt(); }
Status CudaFlushRdmaWrites(int) { return NotBuilt(); }

}  // namespace rdmarpc::internal
