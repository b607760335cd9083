#include "transport/rdma/gpu_registration.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_support.h"

namespace rdmarpc::rdma {
namespace {

bool Exists(const char* path) {
  struct stat st {};
  return stat(path, &st) == 0;
}

Status CheckMode(int gpu, ibv_pd* pd, GpuRdmaMode mode) {
  switch (mode) {
    case GpuRdmaMode::kDmaBuf:
      RDMARPC_RETURN_IF_ERROR(internal::CudaDmaBufSupported(gpu));
      return ProbeNicDmaBuf(pd);
    case GpuRdmaMode::kPeerMemory:
      return ProbePeerMemory();
    case GpuRdmaMode::kStaging:
    case GpuRdmaMode::kAuto:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown GPU RDMA mode");
}

StatusOr<GpuRdmaChoice> Detect(int gpu, ibv_pd* pd, GpuRdmaMode requested,
                               const char* device) {
  RDMARPC_RETURN_IF_ERROR(internal::CudaCheckDevice(gpu));
  if (requested != GpuRdmaMode::kAuto) {
    Status works = CheckMode(gpu, pd, requested);
    if (!works.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          GpuRdmaModeName(requested), " was requested for cuda:", gpu, " and ",
          device, " but does not work: ", works.message()));
    }
    return GpuRdmaChoice{requested, "requested"};
  }
  Status dmabuf = CheckMode(gpu, pd, GpuRdmaMode::kDmaBuf);
  if (dmabuf.ok()) {
    return GpuRdmaChoice{
        GpuRdmaMode::kDmaBuf,
        absl::StrCat("cuda:", gpu, " and ", device, " both support dma-buf")};
  }
  Status peer = ProbePeerMemory();
  if (peer.ok()) {
    return GpuRdmaChoice{GpuRdmaMode::kPeerMemory,
                         absl::StrCat("no dma-buf (", dmabuf.message(),
                                      "); nvidia-peermem is loaded")};
  }
  return GpuRdmaChoice{
      GpuRdmaMode::kStaging,
      absl::StrCat("no dma-buf (", dmabuf.message(), "); no peer memory (",
                   peer.message(), ")")};
}

}  // namespace

StatusOr<GpuRdmaMode> GpuRdmaModeFromEnvironment() {
  const char* env = std::getenv("RDMARPC_GPU_RDMA_MODE");
  if (env == nullptr || *env == '\0') return GpuRdmaMode::kAuto;
  for (GpuRdmaMode m : {GpuRdmaMode::kAuto, GpuRdmaMode::kDmaBuf,
                        GpuRdmaMode::kPeerMemory, GpuRdmaMode::kStaging}) {
    if (std::strcmp(env, GpuRdmaModeName(m)) == 0) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("RDMARPC_GPU_RDMA_MODE='", env,
                   "' is not one of auto, dma-buf, peer-memory, staging"));
}

Status ProbeNicDmaBuf(ibv_pd* pd) {
  // fd -1 is never a dma-buf, so the call fails either way: a provider
  // without dma-buf support says EOPNOTSUPP (or EPROTONOSUPPORT) before
  // looking at the fd; any other error (EBADF, usually) means it got as
  // far as the fd. NCCL reads the answer the same way.
  errno = 0;
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 0, 0, -1, IBV_ACCESS_LOCAL_WRITE);
  int err = errno;
  if (mr != nullptr) {
    ibv_dereg_mr(mr);
    return absl::FailedPreconditionError(
        "the RDMA driver accepted a dma-buf registration with fd -1; not "
        "trusting it");
  }
  if (err != 0 && err != EOPNOTSUPP && err != EPROTONOSUPPORT &&
      err != ENOSYS) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the RDMA device's driver does not take dma-bufs (ibv_reg_dmabuf_mr: ",
      std::strerror(err == 0 ? EOPNOTSUPP : err), ")"));
}

Status ProbePeerMemory() {
  if (Exists("/sys/module/nvidia_peermem")) return absl::OkStatus();
  if (Exists("/sys/kernel/mm/memory_peers/nv_mem/version")) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "the nvidia_peermem kernel module is not loaded (`modprobe "
      "nvidia-peermem`)");
}

StatusOr<GpuRdmaChoice> ChooseGpuRdmaMode(int gpu, ibv_pd* pd,
                                          GpuRdmaMode requested) {
  if (requested == GpuRdmaMode::kAuto) {
    RDMARPC_ASSIGN_OR_RETURN(requested, GpuRdmaModeFromEnvironment());
  }
  const char* device = ibv_get_device_name(pd->context->device);
  using Key = std::tuple<int, std::string, GpuRdmaMode>;
  static std::mutex mu;
  static auto* cache = new std::map<Key, StatusOr<GpuRdmaChoice>>();
  Key key{gpu, device, requested};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return it->second;
  }
  StatusOr<GpuRdmaChoice> choice = Detect(gpu, pd, requested, device);
  std::lock_guard<std::mutex> lock(mu);
  cache->emplace(key, choice);
  return choice;
}

StatusOr<MemoryRegion> RegisterGpuMemory(ibv_pd* pd, void* addr, size_t size,
                                         GpuRdmaMode mode, int access) {
  if (mode == GpuRdmaMode::kPeerMemory) {
    RDMARPC_RETURN_IF_ERROR(internal::CudaSetSyncMemops(addr));
    return RegisterMemory(pd, addr, size, access);
  }
  if (mode != GpuRdmaMode::kDmaBuf) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU memory cannot be registered in mode ", GpuRdmaModeName(mode)));
  }
  RDMARPC_ASSIGN_OR_RETURN(internal::DmaBufRange range,
                           internal::CudaExportDmaBuf(addr, size));
  errno = 0;
  MemoryRegion mr(ibv_reg_dmabuf_mr(pd, range.offset, size,
                                    reinterpret_cast<uintptr_t>(addr), range.fd,
                                    access));
  int err = errno;
  close(range.fd);  // the registration holds its own reference
  if (mr == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("dma-buf registration of ", size,
                     " bytes of GPU memory failed: ", std::strerror(err)));
  }
  return mr;
}

}  // namespace rdmarpc::rdma
