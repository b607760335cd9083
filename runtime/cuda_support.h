// CUDA runtime access, detected at run time. Built with CUDA
// (RDMARPC_HAVE_CUDA) it uses the statically linked CUDA runtime, which works
// on a machine without a driver or GPU (every call then reports UNAVAILABLE);
// built without CUDA every call reports that.
#ifndef RDMARPC_RUNTIME_CUDA_SUPPORT_H_
#define RDMARPC_RUNTIME_CUDA_SUPPORT_H_

#include <cstddef>

#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"

namespace rdmarpc::internal {

int CudaDeviceCountCached();
Status CudaCheckDevice(int index);
StatusOr<TensorBuffer> CudaAllocate(size_t size, int index);
// At least one side is a CUDA device.
Status CudaCopy(void* dst, Device dst_device, const void* src,
                Device src_device, size_t size);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_CUDA_SUPPORT_H_
