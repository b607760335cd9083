// CUDA: driver entry points, resolved through the runtime (no libcuda
// link), for GPUDirect RDMA: dma-buf export, sync memops, and flushing
// RDMA writes before a GPU reads them.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_internal.h"
#include "runtime/cuda_support.h"

namespace rdmarpc::internal {
namespace {

// Resolved once.
struct Driver {
  PFN_cuDeviceGetAttribute_v2000 get_attribute = nullptr;
  PFN_cuMemGetAddressRange_v3020 get_address_range = nullptr;
  PFN_cuMemGetHandleForAddressRange_v11070 get_handle = nullptr;
  PFN_cuPointerSetAttribute_v6000 set_pointer_attribute = nullptr;
  PFN_cuFlushGPUDirectRDMAWrites_v11030 flush_rdma_writes = nullptr;
  std::string missing;  // why a pointer above is null
};

template <typename Fn>
void Resolve(const char* name, unsigned version, Fn* fn, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, version,
                                                     cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess ||
      p == nullptr) {
    absl::StrAppend(missing, missing->empty() ? "" : "; ", name,
                    " not found in the CUDA driver");
    return;
  }
  *fn = reinterpret_cast<Fn>(p);
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    Resolve("cuDeviceGetAttribute", 2000, &d.get_attribute, &d.missing);
    Resolve("cuMemGetAddressRange", 3020, &d.get_address_range, &d.missing);
    Resolve("cuMemGetHandleForAddressRange", 11070, &d.get_handle, &d.missing);
    Resolve("cuPointerSetAttribute", 6000, &d.set_pointer_attribute,
            &d.missing);
    Resolve("cuFlushGPUDirectRDMAWrites", 11030, &d.flush_rdma_writes,
            &d.missing);
    return d;
  }();
  return driver;
}

Status DriverError(const char* what, CUresult r) {
  return absl::InternalError(
      absl::StrCat(what, " failed with CUresult ", static_cast<int>(r)));
}

// Makes the device that owns `ptr` current, so that driver calls on the
// engine thread (which may never have used CUDA) have a context.
Status UsePointersDevice(const void* ptr) {
  cudaPointerAttributes attr{};
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr));
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("not CUDA device memory");
  }
  return UseDevice(attr.device);
}

}  // namespace

Status CudaDmaBufSupported(int gpu) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(gpu));
  const Driver& d = GetDriver();
  if (d.get_attribute == nullptr || d.get_handle == nullptr ||
      d.get_address_range == nullptr) {
    return absl::FailedPreconditionError(d.missing);
  }
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  int supported = 0;
  CUresult r =
      d.get_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, gpu);
  if (r != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDeviceGetAttribute(DMA_BUF_SUPPORTED) failed with CUresult ",
        static_cast<int>(r)));
  }
  if (!supported) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", gpu,
        " cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: "
        "needs an open-source kernel driver and Linux 5.12 or later)"));
  }
  return absl::OkStatus();
}

StatusOr<DmaBufRange> CudaExportDmaBuf(const void* ptr, size_t size) {
  const Driver& d = GetDriver();
  if (d.get_handle == nullptr || d.get_address_range == nullptr) {
    return absl::FailedPreconditionError(d.missing);
  }
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UsePointersDevice(ptr));
  CUdeviceptr base = 0;
  size_t alloc_size = 0;
  CUresult r = d.get_address_range(&base, &alloc_size,
                                   reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) return DriverError("cuMemGetAddressRange", r);
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t start = static_cast<uintptr_t>(base) & ~(page - 1);
  uintptr_t end =
      (static_cast<uintptr_t>(base) + alloc_size + page - 1) & ~(page - 1);
  if (reinterpret_cast<uintptr_t>(ptr) + size > end) {
    return absl::InvalidArgumentError(
        "device range runs past the end of its allocation");
  }
  int fd = -1;
  r = d.get_handle(&fd, static_cast<CUdeviceptr>(start), end - start,
                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) return DriverError("cuMemGetHandleForAddressRange", r);
  return DmaBufRange{fd, reinterpret_cast<uintptr_t>(ptr) - start};
}

Status CudaSetSyncMemops(const void* ptr) {
  const Driver& d = GetDriver();
  if (d.set_pointer_attribute == nullptr) {
    return absl::FailedPreconditionError(d.missing);
  }
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UsePointersDevice(ptr));
  unsigned int one = 1;
  CUresult r = d.set_pointer_attribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                                       reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) return DriverError("cuPointerSetAttribute", r);
  return absl::OkStatus();
}

Status CudaFlushRdmaWrites(int gpu) {
  const Driver& d = GetDriver();
  if (d.get_attribute == nullptr || d.flush_rdma_writes == nullptr) {
    return absl::FailedPreconditionError(d.missing);
  }
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  int ordering = 0;
  CUresult r = d.get_attribute(
      &ordering, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, gpu);
  if (r != CUDA_SUCCESS) {
    return DriverError("cuDeviceGetAttribute(GPU_DIRECT_RDMA_WRITES_ORDERING)",
                       r);
  }
  if (ordering >= CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER) {
    return absl::OkStatus();  // the device orders them itself
  }
  r = d.flush_rdma_writes(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                          CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
  if (r != CUDA_SUCCESS) return DriverError("cuFlushGPUDirectRDMAWrites", r);
  return absl::OkStatus();
}

}  // namespace rdmarpc::internal
