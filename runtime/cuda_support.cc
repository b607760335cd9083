#include "runtime/cuda_support.h"

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#ifdef RDMARPC_HAVE_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "runtime/first_fit.h"
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

#define RDMARPC_CUDA_RETURN_IF_ERROR(call)       \
  do {                                           \
    cudaError_t rdmarpc_cuda_err = (call);       \
    if (rdmarpc_cuda_err != cudaSuccess) {       \
      return CudaError(#call, rdmarpc_cuda_err); \
    }                                            \
  } while (0)

// Restores the calling thread's current device: the runtime runs on user
// and handler threads and must not change theirs.
class DeviceGuard {
 public:
  DeviceGuard() {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

Status UseDevice(int index) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(index));
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return absl::OkStatus();
}

// Driver entry points, resolved once through the runtime (no libcuda link).
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

class EventFence final : public CudaFence {
 public:
  EventFence(int gpu, cudaEvent_t event) : gpu_(gpu), event_(event) {}
  ~EventFence() override {
    DeviceGuard guard;
    cudaSetDevice(gpu_);
    cudaEventDestroy(event_);
  }
  Status Wait() override {
    RDMARPC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }
  cudaEvent_t event() const { return event_; }

 private:
  int gpu_;
  cudaEvent_t event_;
};

// Sends wait on producers' streams; receives must not queue behind them.
enum class Direction { kSend = 0, kReceive = 1 };

// Two non-blocking copy streams per GPU, created on first use. Makes `gpu`
// current (callers hold a DeviceGuard).
StatusOr<cudaStream_t> CopyStream(int gpu, Direction direction) {
  static std::mutex mu;
  static std::vector<std::array<cudaStream_t, 2>> streams;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(gpu)) {
    streams.resize(gpu + 1, {nullptr, nullptr});
  }
  cudaStream_t& stream = streams[gpu][static_cast<int>(direction)];
  if (stream == nullptr) {
    RDMARPC_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  return stream;
}

// Queues `fn` on `stream`; it runs on CUDA's host-function thread.
Status LaunchHost(cudaStream_t stream, std::function<void()> fn) {
  auto* boxed = new std::function<void()>(std::move(fn));
  cudaError_t err = cudaLaunchHostFunc(
      stream,
      [](void* arg) {
        std::unique_ptr<std::function<void()>> f(
            static_cast<std::function<void()>*>(arg));
        (*f)();
      },
      boxed);
  if (err != cudaSuccess) {
    delete boxed;
    return CudaError("cudaLaunchHostFunc", err);
  }
  return absl::OkStatus();
}

Status WaitOn(cudaStream_t stream, const CudaFence* after) {
  if (after == nullptr) return absl::OkStatus();
  const auto* fence = static_cast<const EventFence*>(after);
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, fence->event(), 0));
  return absl::OkStatus();
}

constexpr size_t kStagingChunk = size_t{4} << 20;

// A pageable host side: copy through two pinned chunks so that the CPU
// copy of one overlaps the DMA of the other.
Status CopyViaPinned(int gpu, void* dst, Device dst_device, const void* src,
                     Device src_device, size_t size) {
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream,
                           CopyStream(gpu, Direction::kReceive));
  RDMARPC_ASSIGN_OR_RETURN(TensorBuffer bounce,
                           AllocatePinnedStaging(2 * kStagingChunk));
  cudaEvent_t done[2] = {nullptr, nullptr};
  auto cleanup = [&] {
    for (auto& e : done) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  };
  for (auto& e : done) {
    cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      e = nullptr;
      cleanup();
      return CudaError("cudaEventCreateWithFlags", err);
    }
  }
  const bool to_device = dst_device.is_cuda();
  char* slots[2] = {static_cast<char*>(bounce.data()),
                    static_cast<char*>(bounce.data()) + kStagingChunk};
  size_t offsets[2] = {0, 0};
  size_t lengths[2] = {0, 0};
  bool busy[2] = {false, false};
  Status status;
  auto drain = [&](int k) -> Status {
    if (!busy[k]) return absl::OkStatus();
    busy[k] = false;
    cudaError_t err = cudaEventSynchronize(done[k]);
    if (err != cudaSuccess) return CudaError("cudaEventSynchronize", err);
    if (!to_device) {
      std::memcpy(static_cast<char*>(dst) + offsets[k], slots[k], lengths[k]);
    }
    return absl::OkStatus();
  };
  for (size_t offset = 0, k = 0; offset < size && status.ok();
       offset += kStagingChunk, k ^= 1) {
    status = drain(static_cast<int>(k));
    if (!status.ok()) break;
    size_t n = std::min(kStagingChunk, size - offset);
    cudaError_t err;
    if (to_device) {
      std::memcpy(slots[k], static_cast<const char*>(src) + offset, n);
      err = cudaMemcpyAsync(static_cast<char*>(dst) + offset, slots[k], n,
                            cudaMemcpyDefault, stream);
    } else {
      err = cudaMemcpyAsync(slots[k], static_cast<const char*>(src) + offset, n,
                            cudaMemcpyDefault, stream);
    }
    if (err == cudaSuccess) err = cudaEventRecord(done[k], stream);
    if (err != cudaSuccess) {
      status = CudaError("cudaMemcpyAsync", err);
      break;
    }
    offsets[k] = offset;
    lengths[k] = n;
    busy[k] = true;
  }
  for (int k = 0; k < 2; ++k) {
    Status drained = drain(k);
    if (status.ok()) status = drained;
  }
  (void)src_device;
  cleanup();
  return status;
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

Status CudaCopy(void* dst, Device dst_device, const void* src,
                Device src_device, size_t size) {
  const Device& gpu = dst_device.is_cuda() ? dst_device : src_device;
  DeviceGuard guard;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu.index));
  const void* host = dst_device.is_host()   ? dst
                     : src_device.is_host() ? src
                                            : nullptr;
  if (host != nullptr && size > kStagingChunk && !CudaIsPinnedHost(host)) {
    Status staged =
        CopyViaPinned(gpu.index, dst, dst_device, src, src_device, size);
    if (staged.code() != StatusCode::kResourceExhausted) return staged;
    // No pinned memory to spare: let CUDA stage it.
  }
  // cudaMemcpyDefault: unified addressing tells the direction, including
  // device to device across GPUs.
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, size, cudaMemcpyDefault));
  return absl::OkStatus();
}

StatusOr<TensorBuffer> AllocatePinnedStaging(size_t size) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(0));
  return Pinned().Allocate(size);
}

StatusOr<std::shared_ptr<CudaFence>> CudaRecordFence(int gpu, void* stream) {
  DeviceGuard guard;
  if (stream != nullptr) {
    // An event must be recorded on its own device's stream.
    RDMARPC_CUDA_RETURN_IF_ERROR(
        cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &gpu));
  }
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  cudaEvent_t event;
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  auto fence = std::make_shared<EventFence>(gpu, event);
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(event, static_cast<cudaStream_t>(stream)));
  return std::shared_ptr<CudaFence>(std::move(fence));
}

Status CudaCopyInChunks(int gpu, const CudaFence* after, void* dst,
                        const void* src, size_t size, size_t chunk,
                        std::function<void(size_t, size_t)> on_chunk,
                        int* queued) {
  *queued = 0;
  DeviceGuard guard;
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream,
                           CopyStream(gpu, Direction::kSend));
  RDMARPC_RETURN_IF_ERROR(WaitOn(stream, after));
  auto shared = std::make_shared<std::function<void(size_t, size_t)>>(
      std::move(on_chunk));
  for (size_t offset = 0; offset < size; offset += chunk) {
    size_t n = std::min(chunk, size - offset);
    RDMARPC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        static_cast<char*>(dst) + offset,
        static_cast<const char*>(src) + offset, n, cudaMemcpyDefault, stream));
    RDMARPC_RETURN_IF_ERROR(
        LaunchHost(stream, [shared, offset, n] { (*shared)(offset, n); }));
    ++*queued;
  }
  return absl::OkStatus();
}

Status CudaThen(int gpu, const CudaFence* after, std::function<void()> fn) {
  DeviceGuard guard;
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream,
                           CopyStream(gpu, Direction::kSend));
  RDMARPC_RETURN_IF_ERROR(WaitOn(stream, after));
  return LaunchHost(stream, std::move(fn));
}

Status CudaCopyOrdered(void* dst, Device dst_device, const void* src,
                       Device src_device, size_t size,
                       const ConsumerStream* consumer, TensorBuffer keep) {
  const Device& gpu = dst_device.is_cuda() ? dst_device : src_device;
  DeviceGuard guard;
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream,
                           CopyStream(gpu.index, Direction::kReceive));
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream));
  RDMARPC_ASSIGN_OR_RETURN(std::shared_ptr<CudaFence> done,
                           CudaRecordFence(gpu.index, stream));
  if (consumer == nullptr) return done->Wait();
  const auto* event = static_cast<const EventFence*>(done.get());
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(
      static_cast<cudaStream_t>(consumer->stream), event->event(), 0));
  // Released on the host-function thread: bookkeeping only (pinned pool).
  return LaunchHost(
      stream, [keep = std::move(keep)]() mutable { keep = TensorBuffer(); });
}

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
StatusOr<TensorBuffer> AllocatePinnedStaging(size_t) { return NotBuilt(); }
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

#endif  // RDMARPC_HAVE_CUDA

}  // namespace rdmarpc::internal
