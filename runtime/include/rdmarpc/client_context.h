// rdmarpc/client_context.h: per-call options and results on the client.
//
// One ClientContext per call (like grpc::ClientContext); it must outlive the
// call and cannot be reused.
//
//   rdmarpc::ClientContext ctx;
//   ctx.set_timeout(std::chrono::seconds(2));
//   ctx.AddMetadata("x-request-id", "42");
//   rdmarpc::Status s = stub->Run(&ctx, req, &resp);
//   std::cout << ctx.stats().ToString();   // transport, bytes, copies
#ifndef RDMARPC_CLIENT_CONTEXT_H_
#define RDMARPC_CLIENT_CONTEXT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rdmarpc/memory.h"
#include "rdmarpc/tensor.h"

namespace rdmarpc {

enum class TransportKind { kNone, kGrpc, kRdma };
const char* TransportName(TransportKind kind);  // "none", "grpc", "rdma"

// What one call did. Filled in by the runtime before the call completes.
struct CallStats {
  TransportKind transport = TransportKind::kNone;
  // Why this transport carried the call, in words.
  std::string transport_reason;
  uint64_t call_id = 0;
  // Tensor bytes sent and received (out of band or inline).
  uint64_t tensor_bytes_sent = 0;
  uint64_t tensor_bytes_received = 0;
  // Tensor bytes the CPU copied on this side (staging, gRPC receive, ...).
  // 0 on a zero-copy path.
  uint64_t cpu_copied_bytes = 0;
  // How RDMA reached this side's tensors in CUDA memory ("dma-buf",
  // "peer-memory", "staging"; empty when none went over RDMA) and why.
  std::string gpu_rdma_mode;
  std::string gpu_rdma_reason;

  std::string ToString() const;
};

namespace internal {
// A transport's handle on a running call, so the context can cancel it.
// One canceller may serve many calls (an RDMA connection has one for all of
// its calls): Cancel gets the id the call was attached with.
class CallCanceller {
 public:
  virtual ~CallCanceller() = default;
  virtual void Cancel(uint64_t call_id) = 0;
};
class ClientContextAccess;
}  // namespace internal

class ClientContext {
 public:
  ClientContext() = default;
  ClientContext(const ClientContext&) = delete;
  ClientContext& operator=(const ClientContext&) = delete;

  // The call fails with DEADLINE_EXCEEDED if it has not completed by then.
  void set_deadline(std::chrono::system_clock::time_point deadline) {
    deadline_ = deadline;
  }
  void set_timeout(std::chrono::nanoseconds timeout) {
    deadline_ = std::chrono::system_clock::now() + timeout;
  }
  std::optional<std::chrono::system_clock::time_point> deadline() const {
    return deadline_;
  }

  // Whether the call waits for the server to become reachable (until its
  // deadline) instead of failing UNAVAILABLE at once while none answers,
  // as gRPC's wait-for-ready. Under the 'auto' and 'grpc' policies, a call
  // made while no server listens goes over gRPC and waits there. Under
  // 'rdma', a call made while the channel's RDMA path is down (degraded:
  // the server or its RDMA side not reachable yet, or lost) waits for the
  // channel's probe to bring it back, then goes over RDMA; it fails with
  // DEADLINE_EXCEEDED at its deadline (without one it waits as long as it
  // takes), CANCELLED on TryCancel, and UNAVAILABLE at once where RDMA
  // cannot come back (no RDMA device on a side). Default: no.
  void set_wait_for_ready(bool wait) { wait_for_ready_ = wait; }
  bool wait_for_ready() const { return wait_for_ready_; }

  // Sent to the server with the request. gRPC's rules: a key is lower case
  // letters, digits, '-', '_' and '.', not starting with "grpc-" or
  // "rdmarpc-" (reserved); a value is printable ASCII unless the key ends
  // in "-bin". At most 64 entries and 16 KiB in all. A call whose metadata
  // breaks them fails with INVALID_ARGUMENT (RESOURCE_EXHAUSTED for size)
  // saying which entry.
  void AddMetadata(std::string key, std::string value) {
    metadata_.emplace(std::move(key), std::move(value));
  }
  const std::multimap<std::string, std::string>& metadata() const {
    return metadata_;
  }

  // What the server's handler sent back (ServerContext::AddInitialMetadata
  // and AddTrailingMetadata), whichever transport carried the call. Valid
  // once the call has completed, whatever its status; empty when the
  // server sent none or the call never reached a handler.
  //
  //   for (const auto& [key, value] : ctx.GetServerTrailingMetadata()) ...
  const std::multimap<std::string, std::string>& GetServerInitialMetadata()
      const {
    return server_initial_metadata_;
  }
  const std::multimap<std::string, std::string>& GetServerTrailingMetadata()
      const {
    return server_trailing_metadata_;
  }

  // Where received response tensors land (default: host memory).
  void set_response_placement(Device device) { placement_ = device; }
  Device response_placement() const { return placement_; }

  // The CUDA stream (a cudaStream_t; nullptr is the legacy default stream)
  // that produces the request's device tensors and consumes the response's.
  // The runtime reads a device tensor only after the work queued on this
  // stream before the call started, and response tensors are ordered before
  // work queued on it after the call completes, without a device-wide
  // synchronization. Without a stream set, the call completes only once
  // response tensors are in place, and device tensors are read after the
  // work queued on the legacy default stream. Keep a received device
  // tensor (its TensorView or buffer) until the work queued on this stream
  // has used it: its memory then goes back to the runtime's pool.
  void set_cuda_stream(void* stream) {
    cuda_stream_ = stream;
    has_cuda_stream_ = true;
  }
  bool has_cuda_stream() const { return has_cuda_stream_; }
  void* cuda_stream() const { return cuda_stream_; }

  // Lands the response tensor number `index` (walk order: the order of the
  // tensor fields in a depth-first walk of the set fields by field number)
  // in `buffer` instead of memory the runtime allocates. Over RDMA the
  // server writes straight into it. The call fails with RESOURCE_EXHAUSTED
  // if that tensor is larger than `buffer`. The buffer is borrowed until
  // the call completes.
  //
  //   std::vector<float> out(1 << 20);
  //   ctx.SetResponseTensorBuffer(0, rdmarpc::TensorBuffer::Borrow(
  //                                      out.data(), out.size() * 4));
  void SetResponseTensorBuffer(size_t index, TensorBuffer buffer) {
    if (response_buffers_.size() <= index) response_buffers_.resize(index + 1);
    response_buffers_[index] = std::move(buffer);
  }
  // Indexed like the response's tensors; an empty buffer means none.
  const std::vector<TensorBuffer>& response_tensor_buffers() const {
    return response_buffers_;
  }

  // Cancels the call if it is running (it then completes with CANCELLED),
  // or makes it fail with CANCELLED when started. Thread-safe; the call's
  // callback still runs exactly once.
  void TryCancel();
  bool IsCancelled() const { return cancelled_.load(); }

  // Request tensors to send (Set) and, after completion, response tensors
  // received (Get). Received bytes are owned by this context, or shared
  // through TensorView::buffer().
  CallTensors& tensors() { return tensors_; }
  const CallTensors& tensors() const { return tensors_; }

  // Valid once the call has completed.
  const CallStats& stats() const { return stats_; }

 private:
  friend class internal::ClientContextAccess;
  bool AttachCanceller(std::shared_ptr<internal::CallCanceller> canceller,
                       uint64_t call_id);
  void DetachCanceller();
  // Clears kAttached and waits for the cancellers' readers to go.
  void UnpublishCanceller();

  std::optional<std::chrono::system_clock::time_point> deadline_;
  bool wait_for_ready_ = false;
  std::multimap<std::string, std::string> metadata_;
  std::multimap<std::string, std::string> server_initial_metadata_;
  std::multimap<std::string, std::string> server_trailing_metadata_;
  Device placement_ = Device::Host();
  void* cuda_stream_ = nullptr;
  bool has_cuda_stream_ = false;
  std::vector<TensorBuffer> response_buffers_;
  CallTensors tensors_;
  CallStats stats_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> started_{false};
  // The canceller of the running call, without a lock (a call attaches and
  // detaches one on its datapath): canceller_ is read only by a TryCancel
  // that found it attached and not yet cancelled, counted as a reader in
  // the same step, and is changed only with kAttached clear and no reader
  // left. So a canceller attached after a TryCancel is refused, and one
  // attached before is cancelled once.
  static constexpr uint32_t kAttached = 1;
  static constexpr uint32_t kCancelled = 2;
  static constexpr uint32_t kReader = 4;  // readers count in the bits above
  std::atomic<uint32_t> canceller_state_{0};
  std::shared_ptr<internal::CallCanceller> canceller_;
  uint64_t canceller_call_id_ = 0;  // changed with canceller_
};

}  // namespace rdmarpc

#endif  // RDMARPC_CLIENT_CONTEXT_H_
