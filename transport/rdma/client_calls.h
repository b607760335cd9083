// The client side of one RDMA connection: the state machine of a
// channel's calls on it. A call's request goes as a frame with its small
// parts inline; its large parts are written once the server grants memory.
// The response comes back the same way into memory this side grants. When
// the connection closes, each call in flight is re-sent over gRPC through
// the channel's hooks (or rerouted, when nothing reached a handler), or
// failed when the channel is going away.
//
//   auto endpoint = std::make_shared<ClientEndpoint>(hooks, ...);
//   endpoint->Attach(conn);          // conn created with endpoint as handler
//   endpoint->Start(std::move(call));
//
// Callbacks run with the endpoint's lock released.
#ifndef RDMARPC_TRANSPORT_RDMA_CLIENT_CALLS_H_
#define RDMARPC_TRANSPORT_RDMA_CLIENT_CALLS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "runtime/spare_block.h"
#include "runtime/transport.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/grant_table.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

struct ClientRecord;

// What to do with a call once the endpoint's lock is released.
struct Outcome {
  enum class Next {
    kComplete,  // run the callback with `status`
    kReroute,   // nothing reached a handler: gRPC carries it
    kResend,    // the connection failed with it in flight: re-send
  };
  std::unique_ptr<ClientRecord> record;
  Status status;
  Next next = Next::kComplete;
};
// Most frames settle one call: kept inline, off the heap.
using Outcomes = absl::InlinedVector<Outcome, 1>;

class ClientEndpoint final
    : public Connection::Handler,
      public std::enable_shared_from_this<ClientEndpoint> {
 public:
  ClientEndpoint(internal::FastPathHooks hooks, uint64_t server_instance,
                 uint64_t inline_threshold, GpuRdmaMode gpu_mode,
                 std::string description);
  ~ClientEndpoint() override;

  void Attach(std::shared_ptr<Connection> conn);
  Status health() const;
  // What the connection's watcher needs to know about the calls' progress
  // at `now` (see ChannelOptions::rdma_peer_timeout).
  struct ProgressWatch {
    size_t outstanding = 0;
    // Some call has not moved for a third of the timeout: a ping asks the
    // server which of them its handlers are running.
    bool ping_needed = false;
    // The call that has not moved for longest beyond what it is allowed
    // (`peer_timeout`, plus the time its bytes in flight may take); 0 if
    // none.
    uint64_t stalled_call = 0;
    std::chrono::steady_clock::time_point stalled_since;
    // When the last pong came (the server answers on RDMA).
    std::chrono::steady_clock::time_point last_pong;
  };
  // A call counts as still from max(when it last moved, `not_still_before`).
  ProgressWatch WatchProgress(
      std::chrono::steady_clock::time_point now,
      std::chrono::milliseconds peer_timeout,
      std::chrono::steady_clock::time_point not_still_before = {}) const;
  // From now on a closing connection fails its calls instead of re-sending
  // them (the channel is going away).
  void BeginShutdown();
  // Returns once OnClosed has run.
  void WaitClosed();

  void Start(internal::ClientCall call);
  void Cancel(uint64_t call_id, Status why);
  // Cancels calls past their deadline; returns how long until the next.
  std::chrono::milliseconds ExpireDeadlines();

  Status OnFrame(const FrameView& frame) override;
  Status OnWriteLanded(uint32_t immediate) override;
  void OnClosed(const Status& why) override;

  // Completions run inline that held their thread for
  // internal::kCompletionThreadStall or more.
  uint64_t callback_stalls() const {
    return callback_stalls_.load(std::memory_order_relaxed);
  }
  // Response landings registered for their call alone.
  uint64_t landing_registrations() const {
    return landing_registrations_.load(std::memory_order_relaxed);
  }

 private:
  Status OnGrant(const FrameView& frame, Outcomes* outcomes);
  Status OnResponse(const FrameView& frame, Outcomes* outcomes);
  // A pong names the calls whose handlers the server is running: they are
  // moving.
  Status OnPong(const FrameView& frame);
  // Removes the call and queues its completion (or defers it while writes
  // are pending). Requires mu_.
  void FinishLocked(uint64_t call_id, Status status, Outcomes* outcomes,
                    Outcome::Next next = Outcome::Next::kComplete);
  void Complete(Outcomes outcomes);
  void SendCancelLocked(uint64_t call_id);
  // Fails a call whose response could not be received (its landing memory
  // not allocated or registered). Requires mu_.
  void FailResponseLocked(uint64_t call_id, Status why, bool server_waits,
                          Outcomes* outcomes);
  // Grants the response's landing memory (r.in) to the server, or finishes
  // a call whose response came whole. Requires mu_.
  void GrantResponseLocked(uint64_t call_id, Outcomes* outcomes);
  // The response landed: binds it and finishes the call. Requires mu_.
  void FinishLandedLocked(uint64_t call_id, Outcomes* outcomes);
  // With r.in's windows reserved: registers the response's landings
  // (aside from kRegisterAsideBytes, unless one window over the arena
  // grants them all) and grants them. Requires mu_.
  void GrantReservedLocked(uint64_t call_id, bool server_waits,
                           Outcomes* outcomes);
  // A response that waited for windows (at stage kRegisteringResponse)
  // has them, or its connection closed.
  void GrantWithWindows(uint64_t call_id, Status ready,
                        Connection::WindowGrants windows);
  // From the registration thread (kRegisterAsideBytes): a large response's
  // landing memory is registered (or failed to be) ...
  void GrantRegistered(uint64_t call_id, IncomingPayload in, Status registered);
  // ... and, once written, its windows invalidated (on the polling
  // thread) and its regions registered aside deregistered there: finishes
  // the call (at stage kEndingGrant).
  void FinishLanded(uint64_t call_id);
  // A landed call whose regions were registered aside: drops them there,
  // then FinishLanded. False (nothing to drop aside) leaves the call as it
  // was. Requires mu_.
  bool DeregisterAsideLocked(uint64_t call_id);
  // Once every response part is in: binds the response and its tensors,
  // ordered before the caller's CUDA stream when it named one.
  static Status AcceptResponse(ClientRecord& r);

  const internal::FastPathHooks hooks_;
  const uint64_t server_instance_;
  const uint64_t inline_threshold_;
  const GpuRdmaMode gpu_mode_;
  const std::string description_;
  WireLimits limits_;

  std::atomic<uint64_t> callback_stalls_{0};
  std::atomic<uint64_t> landing_registrations_{0};
  // Set once by Attach, before the first Start, and never changed: Start
  // reads it (and cache_, never reset, only cleared on close) without mu_.
  // The transport that calls Start holds the connection for its whole life.
  Connection* attached_ = nullptr;
  // The completion group of the attached connection (set by Attach and
  // kept after the close): every call in calls_ counts there as awaited,
  // from Start to FinishLocked, under mu_.
  std::shared_ptr<CompletionGroup> group_;
  // Set at Attach, attached to every call (RdmaCanceller).
  std::shared_ptr<internal::CallCanceller> canceller_;
  // Whether closed_ is set: health() and Start read it without mu_.
  std::atomic<bool> lost_{false};
  mutable std::mutex mu_;
  std::shared_ptr<Connection> conn_;
  std::shared_ptr<RegistrationCache> cache_;
  Status closed_;
  // Hashed: a call costs no tree node (heap allocation).
  absl::flat_hash_map<uint64_t, std::unique_ptr<ClientRecord>> calls_;
  // The last finished call's record memory, for the next Start.
  internal::SpareBlock<ClientRecord> spare_record_;
  GrantTable grants_;
  std::chrono::steady_clock::time_point last_pong_;
  bool shutting_down_ = false;
  bool on_closed_done_ = false;
  std::condition_variable closed_cv_;
  // A call whose response landed in full finished (FinishLanded).
  std::condition_variable landed_cv_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_CLIENT_CALLS_H_
