#include "runtime/cuda_support.h"

#include <string>

#include "absl/strings/str_cat.h"

#ifdef RDMARPC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace rdmarpc::internal {

#ifdef RDMARPC_HAVE_CUDA

namespace {

struct CudaProbe {
  int count = 0;
  std::string reason;  // why count is 0
};

const CudaProbe& Probe() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    cudaError_t err = cudaGetDeviceCount(&p.count);
    if (err != cudaSuccess) {
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

Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what,
                                          " failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

}  // namespace

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
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(index));
  cudaError_t err = cudaSetDevice(index);
  if (err != cudaSuccess) return CudaError("cudaSetDevice", err);
  void* p = nullptr;
  err = cudaMalloc(&p, size == 0 ? 1 : size);
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", size, " bytes on cuda:", index,
                     " failed: ", cudaGetErrorString(err)));
  }
  std::shared_ptr<const void> owner(p, [index](const void* q) {
    cudaSetDevice(index);
    cudaFree(const_cast<void*>(q));
  });
  return TensorBuffer::Share(std::move(owner), p, size, Device::Cuda(index));
}

Status CudaCopy(void* dst, Device dst_device, const void* src,
                Device src_device, size_t size) {
  const Device& gpu = dst_device.is_cuda() ? dst_device : src_device;
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(gpu.index));
  cudaError_t err = cudaSetDevice(gpu.index);
  if (err != cudaSuccess) return CudaError("cudaSetDevice", err);
  // cudaMemcpyDefault: unified addressing tells the direction, including
  // device to device across GPUs.
  err = cudaMemcpy(dst, src, size, cudaMemcpyDefault);
  if (err != cudaSuccess) return CudaError("cudaMemcpy", err);
  return absl::OkStatus();
}

#else  // !RDMARPC_HAVE_CUDA

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

#endif  // RDMARPC_HAVE_CUDA

}  // namespace rdmarpc::internal
