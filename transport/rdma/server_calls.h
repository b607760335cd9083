// The server side of one RDMA connection: the state machine of the calls
// a client runs on it. A request is admitted (landing memory reserved
// against the server's pool, registered and granted), dispatched once its
// written parts landed, and answered with the response's small parts in the
// frame and its large ones written into what the client grants. Every
// logged call's outcome is reported to the dispatcher as delivered or
// undelivered (call_log.h), on every path.
//
//   auto endpoint = std::make_shared<ServerEndpoint>(dispatcher, shared, ...);
//   auto conn = Connection::Create(resources, config, endpoint);
//   endpoint->Attach(*conn);
//
// The endpoint's lock guards its calls; the dispatcher's Execute runs with
// it released (an inline handler responds at once).
#ifndef RDMARPC_TRANSPORT_RDMA_SERVER_CALLS_H_
#define RDMARPC_TRANSPORT_RDMA_SERVER_CALLS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "google/protobuf/message.h"
#include "runtime/spare_block.h"
#include "runtime/transport.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/grant_table.h"
#include "transport/rdma/landing_pool.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

// State the endpoints and the running handlers share with the transport,
// which may be gone by the time a handler returns.
struct ServerShared {
  std::mutex mu;
  std::condition_variable cv;
  // Counted without mu (a call's start and end take no lock); once a
  // shutdown waits for 0 (shutdown_waits, set before it looks), the last
  // handler to end notifies cv under mu. Both sequentially consistent: a
  // handler that ends as the shutdown begins to wait either sees the flag
  // or is seen gone.
  std::atomic<int> handlers_running{0};
  std::atomic<bool> shutdown_waits{false};
  int endpoints_open = 0;
  // Handlers still running for connections that closed (their clients
  // re-send over gRPC): cancelled at the shutdown deadline like the rest.
  std::vector<std::weak_ptr<internal::ServerCallState>> detached;
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> accepted_in_shared_domains{0};
  std::atomic<uint64_t> accepted_with_shared_receives{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> protocol_errors{0};
  std::atomic<uint64_t> landing_windows{0};
  std::atomic<uint64_t> landing_registrations{0};
  std::atomic<uint64_t> landing_window_waits{0};
  std::shared_ptr<LandingPool> landing;
};

struct ServerRecord;

class ServerEndpoint final
    : public Connection::Handler,
      public internal::ResponsePath,
      public std::enable_shared_from_this<ServerEndpoint> {
 public:
  ServerEndpoint(internal::Dispatcher* dispatcher,
                 std::shared_ptr<ServerShared> shared, uint64_t threshold,
                 GpuRdmaMode gpu_mode, std::string peer, uint64_t client_id);
  ~ServerEndpoint() override;

  void Attach(std::shared_ptr<Connection> conn);
  std::shared_ptr<Connection> connection();
  // Marks every call cancelled (shutdown past its deadline).
  void CancelAll();

  Status OnFrame(const FrameView& frame) override;
  Status OnWriteLanded(uint32_t immediate) override;
  void OnClosed(const Status& why) override;
  // Closes the connection (a re-send proved the client left it).
  void Abandon(const Status& why) override;

  void Respond(uint64_t call_id,
               const std::shared_ptr<internal::ServerCallState>& state,
               Status status,
               std::shared_ptr<google::protobuf::Message> response);

 private:
  struct ReadyCall {
    std::shared_ptr<internal::ServerCallState> state;
    std::shared_ptr<google::protobuf::Message> request;
    internal::Dispatcher::Completion done;
  };
  using ReadyCalls = absl::InlinedVector<ReadyCall, 1>;
  // OnRequest and OnWriteLanded hand the calls that became ready to the
  // dispatcher once mu_ is released: an inline handler responds at once,
  // which takes mu_. AdmitRequest moves them to `*ready` before it
  // releases mu_ (one lock per request).
  Status OnRequest(const FrameView& frame);
  Status AdmitRequest(const FrameView& frame, ReadyCalls* ready);
  Status LandWrite(uint32_t immediate);
  void ExecuteReady();
  void Execute(ReadyCalls& ready);
  // Grants r.in to the client. Requires mu_.
  void GrantLocked(uint64_t call_id);
  // With r.in's windows reserved: registers its landings (aside from
  // kRegisterAsideBytes, unless one window over the arena grants them
  // all) and grants them. Requires mu_.
  void GrantReservedLocked(uint64_t call_id);
  // A request that waited for windows (at stage kRegistering) has them,
  // or its connection closed.
  void GrantWithWindows(uint64_t call_id,
                        const std::shared_ptr<internal::ServerCallState>& state,
                        Status ready, Connection::WindowGrants windows);
  // The call's record if it is still `state`'s and at `stage` (a
  // ServerRecord::Stage) on an open connection, else null. Requires mu_.
  ServerRecord* FindAtStageLocked(
      uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
      int stage);
  // From the registration thread (kRegisterAsideBytes): the landing memory
  // of a large request is registered (or failed to be) ...
  void GrantRegistered(uint64_t call_id,
                       const std::shared_ptr<internal::ServerCallState>& state,
                       IncomingPayload in, Status registered);
  // ... and, once written, its windows invalidated (on the polling
  // thread) and its regions registered aside deregistered there:
  // dispatches the call (at stage kEndingGrant).
  void DispatchAfterGrant(
      uint64_t call_id,
      const std::shared_ptr<internal::ServerCallState>& state);
  // A landed call whose regions were registered aside: drops them there,
  // then DispatchAfterGrant. False (nothing to drop aside) leaves the call
  // as it was. Requires mu_.
  bool DeregisterAsideLocked(uint64_t call_id);
  // The call's record if it may still be answered. Else null, the call
  // ended: a logged call's outcome kept for its re-send when disconnected,
  // or an error response sent (deadline passed, handler error in `status`,
  // cancelled). Requires mu_.
  ServerRecord* RespondableLocked(
      uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
      Status* status, std::shared_ptr<google::protobuf::Message>* response);
  // Respond's second half, on the handler's thread or (a large response of
  // an inline handler) the registration thread: registers the response's
  // written parts without holding mu_, then sends the response.
  void RegisterAndSend(uint64_t call_id,
                       const std::shared_ptr<internal::ServerCallState>& state,
                       const std::shared_ptr<Connection>& conn,
                       const std::shared_ptr<RegistrationCache>& cache,
                       const ResponseHead& head, OutgoingPayload out,
                       std::shared_ptr<google::protobuf::Message> response);
  Status OnGrant(const FrameView& frame);
  void OnCancel(uint64_t call_id);
  // Parses the landed request and queues it for ExecuteReady. Requires mu_.
  void DispatchLocked(uint64_t call_id);
  // Sends an error response and forgets the call. `answered`: the state
  // of a call whose handler returned, whose metadata goes with it.
  // Requires mu_.
  void FailLocked(uint64_t call_id, const Status& status,
                  bool not_executed = false,
                  const internal::ServerCallState* answered = nullptr);
  // Tells the dispatcher, once `sent` reports, whether the outcome of a
  // logged call reached the client (see call_log.h).
  std::function<void(Status)> SettleWhenSent(
      std::shared_ptr<internal::ServerCallState> state, Status status,
      std::shared_ptr<google::protobuf::Message> response);
  void ForgetLocked(uint64_t call_id);

  internal::Dispatcher* dispatcher_;
  std::shared_ptr<ServerShared> shared_;
  const uint64_t inline_threshold_;
  const GpuRdmaMode gpu_mode_;
  const std::shared_ptr<const std::string> peer_;
  // This connection's calls between admission and their handler's end.
  const std::shared_ptr<std::atomic<uint32_t>> calls_running_ =
      std::make_shared<std::atomic<uint32_t>>(0);
  const uint64_t client_id_;  // from the handshake; 0: calls not logged
  WireLimits limits_;

  std::mutex mu_;
  std::shared_ptr<Connection> conn_;
  // Set by Attach, then only cleared (never replaced).
  std::shared_ptr<RegistrationCache> cache_;
  // Set once by Attach, before the connection polls: Respond reads it
  // without mu_ (RegisterAndSend then decides under mu_).
  std::weak_ptr<Connection> attached_;
  bool closed_ = false;
  // Hashed: a call costs no tree node (heap allocation).
  absl::flat_hash_map<uint64_t, std::unique_ptr<ServerRecord>> calls_;
  // SpinClock time calls_ last became empty; 0 once the next request has
  // recorded the gap (internal::RecordIdleGap), and before the first call.
  uint64_t went_idle_ticks_ = 0;
  // The last forgotten call's record memory, for the next request.
  internal::SpareBlock<ServerRecord> spare_record_;
  // Fault injection only: continuations of responses "lost on the wire",
  // run with an error when the connection closes.
  std::vector<std::function<void(Status)>> lost_sends_;
  GrantTable grants_;
  // Calls ready to run (Execute). Inline: a call at a time is the common
  // case, and swapping it out must not cost an allocation per call.
  ReadyCalls ready_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_SERVER_CALLS_H_
