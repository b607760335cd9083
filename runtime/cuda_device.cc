// CUDA: which GPUs exist, errors, the current-device guard, device memory.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_internal.h"
#include "runtime/cuda_support.h"

namespace rdmarpc::internal {
namespace {

// Whether the driver library is installed at all (the runtime loads it by
// this name).
bool DriverInstalled() {
  void* handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) handle = dlopen("libcuda.so.1", RTLD_LAZY);
  if (handle == nullptr) return false;
  dlclose(handle);
  return true;
}

struct CudaProbe {
  int count = 0;
  std::string reason;  // why count is 0
};

const CudaProbe& Probe() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    cudaError_t err = cudaGetDeviceCount(&p.count);
    if (err == cudaErrorInsufficientDriver && !DriverInstalled()) {
      // The runtime says "driver version is insufficient" when there is no
      // driver at all, which sends people updating a driver they lack.
      p.count = 0;
      p.reason =
          "CUDA unavailable: no NVIDIA driver on this machine (libcuda.so.1 "
          "not found): it has no GPU, or the GPU's driver is not installed";
    } else if (err == cudaErrorInsufficientDriver) {
      int runtime = 0;
      int driver = 0;
      (void)cudaRuntimeGetVersion(&runtime);
      (void)cudaDriverGetVersion(&driver);
      p.count = 0;
      p.reason = absl::StrCat(
          "CUDA unavailable: the NVIDIA driver supports CUDA ", driver / 1000,
          ".", driver % 1000 / 10, " but rdmarpc was built with CUDA ",
          runtime / 1000, ".", runtime % 1000 / 10,
          "; update the driver or build rdmarpc with an older toolkit");
    } else if (err != cudaSuccess) {
      p.count = 0;
      p.reason = absl::StrCat("CUDA unavailable: ", cudaGetErrorName(err), " (",
                              cudaGetErrorString(err), ")");
    } else if (p.count == 0) {
      p.reason = "CUDA unavailable: no GPU found";
    }
    return p;
  }();
  return probe;
}

}  // namespace

Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what,
                                          " failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

DeviceGuard::DeviceGuard() {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

Status UseDevice(int index) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(index));
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return absl::OkStatus();
}

StatusOr<UniqueEvent> CreateEvent() {
  cudaEvent_t event = nullptr;
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return UniqueEvent(event);
}

StatusOr<UniqueStream> CreateNonBlockingStream() {
  cudaStream_t stream = nullptr;
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return UniqueStream(stream);
}

int CudaDeviceCountCached() { return Probe().count; }

Status CudaCheckDevice(int index) {
  const CudaProbe& p = Probe();
  if (p.count == 0) return absl::UnavailableError(p.reason);
  if (index < 0 || index >= p.count) {
    return absl::UnavailableError(absl::StrCat(
        "CUDA device ", index, " does not exist (", p.count, " found)"));
  }
  return absl::OkStatus();
}

StatusOr<TensorBuffer> CudaAllocate(size_t size, int index) {
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UseDevice(index));
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size == 0 ? 1 : size);
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", size, " bytes on cuda:", index,
                     " failed: ", cudaGetErrorString(err)));
  }
  std::shared_ptr<const void> owner(p, [index](const void* q) {
    DeviceGuard restore;
    cudaSetDevice(index);
    cudaFree(const_cast<void*>(q));
  });
  return TensorBuffer::Share(std::move(owner), p, size, Device::Cuda(index));
}

bool CudaIsPinnedHost(const void* ptr) {
  if (Probe().count == 0) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

}  // namespace rdmarpc::internal
