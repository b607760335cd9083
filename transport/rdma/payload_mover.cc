#include "transport/rdma/payload_mover.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_support.h"
#include "transport/rdma/gpu_registration.h"

namespace rdmarpc::rdma {
namespace {

constexpr size_t kPageBytes = 4096;

// Host landing memory, zeroed: a peer that writes less than its grant and
// announces it done must not show the reader what an earlier call (of any
// peer) left in the same memory. Small blocks come from the heap and are
// cleared; large ones are mapped afresh, which the kernel zeroes, and
// unmapped aside (see kRegisterAsideBytes) wherever their last user lets
// them go.
StatusOr<TensorBuffer> AllocateHostLanding(uint64_t size) {
  if (size < kRegisterAsideBytes) {
    RDMARPC_ASSIGN_OR_RETURN(TensorBuffer buffer, TensorBuffer::Allocate(size));
    std::memset(buffer.data(), 0, size);
    return buffer;
  }
  const size_t mapped = (size + kPageBytes - 1) / kPageBytes * kPageBytes;
  void* data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map ", size,
        " bytes of host memory to land a tensor in: ", std::strerror(errno)));
  }
  std::shared_ptr<const void> owner(data, [mapped](const void* p) {
    RunAside([p, mapped] { munmap(const_cast<void*>(p), mapped); });
  });
  return TensorBuffer::Share(std::move(owner), data, size, Device::Host());
}

class HostMover final : public PayloadMover {
 public:
  GpuRdmaMode mode() const override { return GpuRdmaMode::kStaging; }

  Status PrepareSource(const TensorBuffer& buffer, PartSource* source,
                       KeptBuffers*) const override {
    source->data = buffer.data();
    return absl::OkStatus();
  }
  StatusOr<LocalMemory> RegisterSource(const PartSource& source,
                                       RegistrationCache* cache,
                                       ibv_pd*) const override {
    return cache->ForSend(source.data, source.size);
  }

  StatusOr<TensorBuffer> AllocateLanding(Device, uint64_t size,
                                         TensorBuffer supplied,
                                         TensorBuffer*) const override {
    if (!supplied.empty()) return supplied;
    return AllocateHostLanding(size);
  }
  bool LandsThroughWindows() const override { return true; }
  StatusOr<MemoryRegion> RegisterLanding(ibv_pd* pd,
                                         const TensorBuffer& landing,
                                         LandingAccess access) const override {
    return rdma::RegisterLanding(pd, landing.data(), landing.size(), access);
  }
  Status AfterLanded(const TensorBuffer&) const override {
    return absl::OkStatus();
  }
};

// dma-buf or peer-memory: the NIC reads and writes GPU memory itself.
class GpuDirectMover final : public PayloadMover {
 public:
  explicit GpuDirectMover(GpuRdmaMode mode) : mode_(mode) {}
  GpuRdmaMode mode() const override { return mode_; }

  Status PrepareSource(const TensorBuffer& buffer, PartSource* source,
                       KeptBuffers*) const override {
    source->data = buffer.data();
    return absl::OkStatus();
  }
  StatusOr<LocalMemory> RegisterSource(const PartSource& source,
                                       RegistrationCache*,
                                       ibv_pd* pd) const override {
    RDMARPC_ASSIGN_OR_RETURN(
        MemoryRegion mr,
        RegisterGpuMemory(pd, const_cast<void*>(source.data), source.size,
                          mode_, IBV_ACCESS_LOCAL_WRITE));
    auto shared = std::make_shared<MemoryRegion>(std::move(mr));
    return LocalMemory{(*shared)->lkey, shared, false};
  }

  StatusOr<TensorBuffer> AllocateLanding(Device device, uint64_t size,
                                         TensorBuffer supplied,
                                         TensorBuffer*) const override {
    if (!supplied.empty()) return supplied;
    RDMARPC_ASSIGN_OR_RETURN(TensorBuffer landing,
                             internal::AllocateGpuLanding(device.index, size));
    // Pool memory held earlier calls' tensors, and cudaMalloc's is not
    // zeroed either. A large landing's clear is waited for in
    // RegisterLanding, which runs aside for it (kRegisterAsideBytes): a
    // GPU busy with long kernels may run it late.
    RDMARPC_RETURN_IF_ERROR(internal::CudaQueueClear(landing));
    if (size < kRegisterAsideBytes) {
      RDMARPC_RETURN_IF_ERROR(internal::CudaWaitForClears(device.index));
    }
    return landing;
  }
  // Windows over dma-buf and peer-memory regions were never tried on a
  // device: GPU landings keep regions of their own.
  bool LandsThroughWindows() const override { return false; }
  StatusOr<MemoryRegion> RegisterLanding(ibv_pd* pd,
                                         const TensorBuffer& landing,
                                         LandingAccess) const override {
    if (landing.size() >= kRegisterAsideBytes) {
      RDMARPC_RETURN_IF_ERROR(
          internal::CudaWaitForClears(landing.device().index));
    }
    return RegisterGpuMemory(pd, landing.data(), landing.size(), mode_,
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  }
  Status AfterLanded(const TensorBuffer& landing) const override {
    return internal::CudaFlushRdmaWrites(landing.device().index);
  }

 private:
  const GpuRdmaMode mode_;
};

// Through pinned host buffers: the host mover's registrations, plus the
// copies payload.cc queues between the pinned buffer and the GPU.
class GpuStagingMover final : public PayloadMover {
 public:
  GpuRdmaMode mode() const override { return GpuRdmaMode::kStaging; }

  Status PrepareSource(const TensorBuffer& buffer, PartSource* source,
                       KeptBuffers* keep) const override {
    RDMARPC_ASSIGN_OR_RETURN(TensorBuffer pinned,
                             internal::AllocatePinnedStaging(buffer.size()));
    source->data = pinned.data();
    source->staged_from = buffer.data();
    source->gpu = buffer.device().index;
    keep->push_back(std::move(pinned));
    return absl::OkStatus();
  }
  StatusOr<LocalMemory> RegisterSource(const PartSource& source,
                                       RegistrationCache* cache,
                                       ibv_pd*) const override {
    return cache->ForSend(source.data, source.size);
  }

  StatusOr<TensorBuffer> AllocateLanding(
      Device, uint64_t size, TensorBuffer supplied,
      TensorBuffer* staged_to) const override {
    *staged_to = std::move(supplied);
    RDMARPC_ASSIGN_OR_RETURN(TensorBuffer landing,
                             internal::AllocatePinnedStaging(size));
    // The pinned pool is shared with staged sends: a block may hold this
    // process's outgoing bytes for any peer. Large ones are cleared in
    // RegisterLanding, which runs aside for them (kRegisterAsideBytes).
    if (size < kRegisterAsideBytes) std::memset(landing.data(), 0, size);
    return landing;
  }
  bool LandsThroughWindows() const override { return true; }
  StatusOr<MemoryRegion> RegisterLanding(ibv_pd* pd,
                                         const TensorBuffer& landing,
                                         LandingAccess access) const override {
    if (landing.size() >= kRegisterAsideBytes) {
      std::memset(landing.data(), 0, landing.size());
    }
    return rdma::RegisterLanding(pd, landing.data(), landing.size(), access);
  }
  Status AfterLanded(const TensorBuffer&) const override {
    return absl::OkStatus();  // the copy to the GPU follows
  }
};

const HostMover kHost;
const GpuStagingMover kGpuStaging;
const GpuDirectMover kGpuDmaBuf(GpuRdmaMode::kDmaBuf);
const GpuDirectMover kGpuPeerMemory(GpuRdmaMode::kPeerMemory);

}  // namespace

const PayloadMover& GpuMoverForTesting(GpuRdmaMode mode) {
  switch (mode) {
    case GpuRdmaMode::kDmaBuf:
      return kGpuDmaBuf;
    case GpuRdmaMode::kPeerMemory:
      return kGpuPeerMemory;
    default:
      return kGpuStaging;
  }
}

MoverChoice ChooseMover(Device device, const GpuAccess& gpu) {
  if (!device.is_cuda()) return {&kHost, "", ""};
  auto choice = ChooseGpuRdmaMode(device.index, gpu.pd, gpu.requested);
  if (!choice.ok()) {
    return {&kGpuStaging, GpuRdmaModeName(GpuRdmaMode::kStaging),
            absl::StrCat(choice.status().message(), "; staging instead")};
  }
  const PayloadMover* mover = &kGpuStaging;
  if (choice->mode == GpuRdmaMode::kDmaBuf) mover = &kGpuDmaBuf;
  if (choice->mode == GpuRdmaMode::kPeerMemory) mover = &kGpuPeerMemory;
  return {mover, GpuRdmaModeName(choice->mode), std::move(choice->reason)};
}

}  // namespace rdmarpc::rdma
