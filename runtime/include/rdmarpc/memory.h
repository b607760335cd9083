// rdmarpc/memory.h: memory that tensor bytes live in.
//
// A TensorBuffer is a contiguous block of bytes in host memory or in CUDA
// device memory, with its ownership made explicit:
//
//   // Borrowed: the caller keeps `data` valid and unchanged until the call
//   // that sends it has completed (blocking call returned, callback ran or
//   // future became ready).
//   auto b = rdmarpc::TensorBuffer::Borrow(data, n);
//
//   // Owned: the buffer frees itself when the last copy of it is destroyed.
//   RDMARPC_ASSIGN_OR_RETURN(auto o, rdmarpc::TensorBuffer::Allocate(
//                                        n, rdmarpc::Device::Cuda(0)));
//
// Copies of a TensorBuffer share the same bytes (like std::shared_ptr).
//
// A MemoryPool hands out TensorBuffers from large regions that a transport
// can register with an RDMA device once, at start (see MemoryPool::Regions).
#ifndef RDMARPC_MEMORY_H_
#define RDMARPC_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "rdmarpc/status.h"
#include "rdmarpc/tensor.pb.h"

namespace rdmarpc {

// A place bytes can live: host memory, or the memory of one CUDA device.
struct Device {
  DeviceType type = DEVICE_TYPE_HOST;
  int index = 0;

  static Device Host() { return {DEVICE_TYPE_HOST, 0}; }
  static Device Cuda(int index) { return {DEVICE_TYPE_CUDA, index}; }
  bool is_host() const { return type == DEVICE_TYPE_HOST; }
  bool is_cuda() const { return type == DEVICE_TYPE_CUDA; }
  bool operator==(const Device&) const = default;
  std::string ToString() const;  // "host" or "cuda:N"
};

class TensorBuffer {
 public:
  // An empty buffer (no bytes, host).
  TensorBuffer() = default;

  // Wraps memory the caller owns. The caller keeps [data, data + size) valid
  // (and, while it is being sent, unchanged) until every call using this
  // buffer has completed.
  static TensorBuffer Borrow(const void* data, size_t size,
                             Device device = Device::Host());

  // Wraps memory whose lifetime `owner` controls: the bytes stay valid while
  // any copy of the returned buffer (or of `owner`) lives.
  static TensorBuffer Share(std::shared_ptr<const void> owner, const void* data,
                            size_t size, Device device = Device::Host());

  // Allocates `size` bytes on `device` (64-byte aligned on the host). The
  // bytes are uninitialized and freed when the last copy is destroyed.
  // Fails with RESOURCE_EXHAUSTED when memory is short and UNAVAILABLE when
  // `device` is a CUDA device that this process cannot use.
  static StatusOr<TensorBuffer> Allocate(size_t size,
                                         Device device = Device::Host());

  // The bytes. Writable only for buffers from Allocate() or for memory the
  // caller knows to be writable; the runtime never writes to a borrowed
  // buffer that is being sent.
  void* data() const { return data_; }
  size_t size() const { return size_; }
  Device device() const { return device_; }
  bool empty() const { return size_ == 0; }

  // A sub-range sharing this buffer's ownership.
  TensorBuffer Slice(size_t offset, size_t size) const;

 private:
  std::shared_ptr<const void> owner_;
  void* data_ = nullptr;
  size_t size_ = 0;
  Device device_;
};

// A source of TensorBuffers carved from one large allocation, so that a
// call does not pay for an allocation (or, registered with
// RegisterMemoryForRdma, for a registration) per buffer.
class MemoryPool {
 public:
  virtual ~MemoryPool() = default;

  // Returns a buffer of `size` bytes; it goes back to the pool when its last
  // copy is destroyed. RESOURCE_EXHAUSTED when the pool cannot serve it.
  virtual StatusOr<TensorBuffer> Allocate(size_t size) = 0;

  virtual Device device() const = 0;
};

// A pool of `capacity` bytes of host memory, carved into buffers with a
// first-fit free list (64-byte granularity). The pool must outlive every
// buffer it handed out.
std::unique_ptr<MemoryPool> NewHostMemoryPool(size_t capacity);

// A pool of `capacity` bytes of memory on CUDA device `index` (one
// cudaMalloc), carved like the host pool. Landing memory for tensors placed
// on a GPU comes from such a pool, so a call does not pay for cudaMalloc.
// UNAVAILABLE without a usable GPU; RESOURCE_EXHAUSTED when the device
// cannot hold `capacity`. The pool must outlive every buffer it handed out.
StatusOr<std::unique_ptr<MemoryPool>> NewCudaMemoryPool(int index,
                                                        size_t capacity);

// How the RDMA transport reaches tensors in CUDA memory, best first:
//   kDmaBuf      the GPU exports the allocation as a dma-buf and the NIC
//                registers it (ibv_reg_dmabuf_mr): the NIC reads and
//                writes GPU memory directly.
//   kPeerMemory  the nvidia-peermem kernel module lets ibv_reg_mr pin GPU
//                memory: direct as well, on older kernels and drivers.
//   kStaging     bytes pass through pinned host buffers, copied to and from
//                the GPU in chunks on a CUDA stream.
// kAuto picks the best mode that detection says works for each (GPU, RDMA
// device) pair; forcing a mode that does not work fails the GPU part of a
// call over RDMA, which then goes over gRPC with the reason. The
// environment variable RDMARPC_GPU_RDMA_MODE (dma-buf, peer-memory,
// staging) overrides kAuto.
enum class GpuRdmaMode { kAuto, kDmaBuf, kPeerMemory, kStaging };
// "auto", "dma-buf", "peer-memory", "staging".
const char* GpuRdmaModeName(GpuRdmaMode mode);

// Number of usable CUDA devices: 0 when this build has no CUDA support, when
// the driver is missing, or when the machine has no GPU (never an error).
int CudaDeviceCount();

// OK when CUDA device `index` can be used; otherwise UNAVAILABLE with the
// reason ("built without CUDA", "no CUDA driver: ...", "no GPU", ...).
Status CudaDeviceStatus(int index);

// Registers host memory [data, data + size) (widened to whole pages) for
// sending over RDMA: each connection registers it once, at its first use,
// and keeps the registration, so calls that send tensors from it skip the
// per-call registration (and its page pinning). Without it, the RDMA
// transport registers a borrowed buffer for the duration of each call.
//
//   std::vector<float> weights(1 << 24);
//   RDMARPC_RETURN_IF_ERROR(rdmarpc::RegisterMemoryForRdma(
//       weights.data(), weights.size() * sizeof(float)));
//   ... calls that send tensors from `weights` ...
//   RDMARPC_RETURN_IF_ERROR(rdmarpc::UnregisterMemoryForRdma(weights.data()));
//
// The memory must stay allocated until UnregisterMemoryForRdma(data): a
// registration pins the pages it saw, so after a free and a new allocation
// at the same address it would send the old bytes. INVALID_ARGUMENT for an
// empty range or one that overlaps a registered range.
Status RegisterMemoryForRdma(const void* data, size_t size);
// Drops the registration made with RegisterMemoryForRdma(data, ...) on
// every connection; calls in flight keep theirs until they complete.
// NOT_FOUND if `data` starts no registered range.
Status UnregisterMemoryForRdma(const void* data);

// Copies `size` bytes between any two devices (host or CUDA), synchronously.
// Between pageable host memory and a GPU, large copies go through pinned
// staging buffers in pipelined chunks.
Status CopyBytes(void* dst, Device dst_device, const void* src,
                 Device src_device, size_t size);

}  // namespace rdmarpc

#endif  // RDMARPC_MEMORY_H_
