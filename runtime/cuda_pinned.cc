// CUDA: the pool of pinned host memory that staging copies go through.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_internal.h"
#include "runtime/cuda_support.h"
#include "runtime/first_fit.h"

namespace rdmarpc::internal {
namespace {

// Pinned host memory in regions that are never freed (see the header).
class PinnedPool {
 public:
  PinnedPool() {
    limit_ = uint64_t{4} << 30;
    if (const char* env = std::getenv("RDMARPC_CUDA_STAGING_BYTES")) {
      limit_ = std::strtoull(env, nullptr, 10);
    }
  }

  StatusOr<TensorBuffer> Allocate(size_t size) {
    size_t rounded =
        std::max<size_t>((size + kGranule - 1) / kGranule, 1) * kGranule;
    size_t grow = std::max(rounded, kRegionBytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& region : regions_) {
        if (auto at = region->fit.Take(rounded)) {
          return Hand(*region, *at, size, rounded);
        }
      }
      if (total_ + grow > limit_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("pinned staging memory is at its limit of ", limit_,
                         " bytes (RDMARPC_CUDA_STAGING_BYTES); ", size,
                         " more bytes do not fit"));
      }
      total_ += grow;  // reserved while pinning, outside the lock
    }
    // Pinning takes long, and CUDA's host functions release buffers under
    // mu_: never pin while holding it.
    void* base = nullptr;
    cudaError_t err = cudaHostAlloc(&base, grow, cudaHostAllocPortable);
    std::lock_guard<std::mutex> lock(mu_);
    if (err != cudaSuccess) {
      total_ -= grow;
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaHostAlloc of ", grow,
          " bytes of pinned staging memory failed: ", cudaGetErrorString(err)));
    }
    regions_.push_back(std::make_unique<Region>(base, grow));
    Region& region = *regions_.back();
    return Hand(region, *region.fit.Take(rounded), size, rounded);
  }

 private:
  static constexpr size_t kGranule = 4096;
  static constexpr size_t kRegionBytes = size_t{64} << 20;

  struct Region {
    Region(void* b, size_t n) : base(static_cast<char*>(b)), fit(n) {}
    char* base;
    FirstFit fit;
  };

  TensorBuffer Hand(Region& region, size_t at, size_t size, size_t rounded) {
    std::shared_ptr<const void> owner(
        region.base + at, [this, &region, at, rounded](const void*) {
          std::lock_guard<std::mutex> lock(mu_);
          region.fit.Give(at, rounded);
        });
    return TensorBuffer::Share(std::move(owner), region.base + at, size);
  }

  std::mutex mu_;
  uint64_t limit_;
  uint64_t total_ = 0;
  std::vector<std::unique_ptr<Region>> regions_;
};

PinnedPool& Pinned() {
  static PinnedPool* pool = new PinnedPool();  // lives as long as the process
  return *pool;
}

}  // namespace

StatusOr<TensorBuffer> AllocatePinnedStaging(size_t size) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(0));
  return Pinned().Allocate(size);
}

}  // namespace rdmarpc::internal
