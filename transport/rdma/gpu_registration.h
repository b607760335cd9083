// How the RDMA transport reaches tensors in CUDA memory: the mode chosen
// per (GPU, RDMA device), its detection, and registration in that mode.
//
// Detection, best first (docs/design.md, "GPU payloads"):
//   dma-buf      the GPU exports dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_-
//                SUPPORTED) and the NIC's driver takes them: an
//                ibv_reg_dmabuf_mr with fd -1 fails with an error other
//                than EOPNOTSUPP / EPROTONOSUPPORT / ENOSYS (EBADF, as a
//                rule), as NCCL probes it.
//   peer-memory  nvidia-peermem is loaded (/sys/module/nvidia_peermem, or
//                the older nv_peer_mem's /sys/kernel/mm/memory_peers/nv_mem):
//                ibv_reg_mr takes device pointers.
//   staging      always: pinned host buffers and CUDA copies.
//
//   RDMARPC_ASSIGN_OR_RETURN(GpuRdmaChoice c,
//                            ChooseGpuRdmaMode(0, pd, GpuRdmaMode::kAuto));
//   if (c.mode != GpuRdmaMode::kStaging) {
//     RDMARPC_ASSIGN_OR_RETURN(MemoryRegion mr, RegisterGpuMemory(
//         pd, dev_ptr, n, c.mode, IBV_ACCESS_LOCAL_WRITE));
//   }
#ifndef RDMARPC_TRANSPORT_RDMA_GPU_REGISTRATION_H_
#define RDMARPC_TRANSPORT_RDMA_GPU_REGISTRATION_H_

#include <cstddef>
#include <string>

#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

struct GpuRdmaChoice {
  GpuRdmaMode mode = GpuRdmaMode::kStaging;  // never kAuto
  std::string reason;                        // why this mode, in words
};

// The mode for GPU `gpu` and the RDMA device of `pd`. kAuto (unless
// RDMARPC_GPU_RDMA_MODE names a mode) picks the best mode detection
// accepts; a named mode is checked and FAILED_PRECONDITION says why it
// cannot work. Detection runs once per (GPU, device, request).
[[nodiscard]] StatusOr<GpuRdmaChoice> ChooseGpuRdmaMode(int gpu, ibv_pd* pd,
                                                        GpuRdmaMode requested);

// Registers GPU memory [addr, addr + size) for `access` in a direct mode
// (dma-buf or peer-memory).
[[nodiscard]] StatusOr<MemoryRegion> RegisterGpuMemory(ibv_pd* pd, void* addr,
                                                       size_t size,
                                                       GpuRdmaMode mode,
                                                       int access);

// The detection steps, each OK or FAILED_PRECONDITION with the reason.
[[nodiscard]] Status ProbeNicDmaBuf(ibv_pd* pd);
[[nodiscard]] Status ProbePeerMemory();

// RDMARPC_GPU_RDMA_MODE parsed ("dma-buf", "peer-memory", "staging";
// kAuto when unset). INVALID_ARGUMENT for anything else.
[[nodiscard]] StatusOr<GpuRdmaMode> GpuRdmaModeFromEnvironment();

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_GPU_REGISTRATION_H_
