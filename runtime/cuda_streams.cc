// CUDA: the runtime's copy streams, fences, work queued after them (copies
// and host functions), and copies ordered before a consumer's stream.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "runtime/cuda_internal.h"
#include "runtime/cuda_support.h"

namespace rdmarpc::internal {
namespace {

class EventFence final : public CudaFence {
 public:
  explicit EventFence(UniqueEvent event) : event_(std::move(event)) {}
  Status Wait() override {
    RDMARPC_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_.get()));
    return absl::OkStatus();
  }
  cudaEvent_t event() const { return event_.get(); }

 private:
  UniqueEvent event_;
};

// Sends wait on producers' streams; receives must not queue behind them;
// clears of landing memory, waited for at once, queue behind neither.
enum class Direction { kSend = 0, kReceive = 1, kClear = 2 };

// Three non-blocking streams per GPU, created on first use. Makes `gpu`
// current (callers hold a DeviceGuard).
// They live until the process exits: created after the CUDA runtime's own
// exit handler is registered, they are destroyed before it runs.
StatusOr<cudaStream_t> CopyStream(int gpu, Direction direction) {
  static std::mutex mu;
  static std::vector<std::array<UniqueStream, 3>> streams;
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(gpu)) streams.resize(gpu + 1);
  UniqueStream& stream = streams[gpu][static_cast<int>(direction)];
  if (stream == nullptr) {
    RDMARPC_ASSIGN_OR_RETURN(stream, CreateNonBlockingStream());
  }
  return stream.get();
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

}  // namespace

StatusOr<cudaStream_t> ReceiveCopyStream(int gpu) {
  return CopyStream(gpu, Direction::kReceive);
}

Status CudaQueueClear(const TensorBuffer& buffer) {
  DeviceGuard guard;
  RDMARPC_ASSIGN_OR_RETURN(
      cudaStream_t stream,
      CopyStream(buffer.device().index, Direction::kClear));
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(buffer.data(), 0, buffer.size(), stream));
  return absl::OkStatus();
}

Status CudaWaitForClears(int gpu) {
  DeviceGuard guard;
  RDMARPC_ASSIGN_OR_RETURN(cudaStream_t stream,
                           CopyStream(gpu, Direction::kClear));
  RDMARPC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

StatusOr<std::shared_ptr<CudaFence>> CudaRecordFence(int gpu, void* stream) {
  DeviceGuard guard;
  if (stream != nullptr) {
    // An event must be recorded on its own device's stream.
    RDMARPC_CUDA_RETURN_IF_ERROR(
        cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &gpu));
  }
  RDMARPC_RETURN_IF_ERROR(UseDevice(gpu));
  RDMARPC_ASSIGN_OR_RETURN(UniqueEvent event, CreateEvent());
  auto fence = std::make_shared<EventFence>(std::move(event));
  RDMARPC_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(fence->event(), static_cast<cudaStream_t>(stream)));
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

}  // namespace rdmarpc::internal
