// The boundary between the runtime and its transports.
//
// Generated code and the user API talk to Channel and Server only; those
// hand each call to a ClientTransport or receive it from a ServerTransport.
// A transport moves bytes; message parsing, tensor validation and placement
// live in codec.h so every transport applies the same checks.
#ifndef RDMARPC_RUNTIME_TRANSPORT_H_
#define RDMARPC_RUNTIME_TRANSPORT_H_

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

#include "google/protobuf/message.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/server.h"
#include "rdmarpc/status.h"
#include "runtime/codec.h"

namespace rdmarpc::internal {

// One client call as handed to a transport. `ctx`, `request` and `response`
// are borrowed until `done` runs; the transport runs `done` exactly once.
struct ClientCall {
  std::string method;
  ClientContext* ctx = nullptr;
  const google::protobuf::Message* request = nullptr;
  google::protobuf::Message* response = nullptr;
  uint64_t call_id = 0;
  uint64_t max_response_tensor_bytes = 0;
  // Set when the call is re-sent after the transport that first carried it
  // failed with the request possibly executed; the server runs it at most
  // once per (client_id, call_id).
  struct Resend {
    uint64_t client_id = 0;
    uint64_t server_instance = 0;
    std::chrono::steady_clock::time_point first_sent;
  };
  std::optional<Resend> resend;
  std::function<void(Status)> done;
  // `done` only wakes a thread that waits for it (Channel::Call,
  // CallFuture), or the user asked for it (run_callbacks_inline): a
  // transport may run it on its own thread, such as the RDMA completion
  // engine, instead of handing it to the callback thread.
  bool done_runs_inline = false;
  // `done` only wakes a thread that waits for it (Channel::Call,
  // CallFuture), so any polling thread may run it. A user's inline
  // callback runs on the engine or on a caller blocked on its own
  // channel, never on a caller of another channel that happens to share
  // its completion queue (which may hold a lock the callback takes).
  bool done_only_wakes = false;
  // The thread that calls Start waits for `done` right after (Channel::Call):
  // a transport may drive the whole call on it and return once done ran
  // (gRPC), or offer it the queue to poll while it waits (RDMA,
  // OfferCallerPoll). Only the router's first hand-off keeps it; a re-send
  // never blocks.
  bool caller_drives = false;
};

class ClientTransport {
 public:
  virtual ~ClientTransport() = default;
  virtual void Start(ClientCall call) = 0;
};

// How a fast transport (RDMA) hands work back to the router that connected
// it. Both may run on the transport's own threads, never under its locks,
// and never after its destructor returned.
struct FastPathHooks {
  uint64_t client_id = 0;  // names the channel's calls to the server
  // Carries a call the fast path cannot: one not sent (device memory it
  // cannot reach, a failed registration, `not_executed`), or one in flight
  // when the connection failed (call.resend set). `why` is for its stats.
  std::function<void(ClientCall call, std::string why)> reroute;
  // The connection failed: `why` and the trigger in a few words. Runs
  // once, before the connection's calls are rerouted.
  std::function<void(const Status& why, const std::string& trigger)> lost;
};

// A fast transport's traffic, for ChannelTransportStats; waits_for_credit
// counts frames and writes that waited for the peer's credits.
struct FastPathCounters {
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t writes_posted = 0;
  // Of those, the ones the poster thread posted (software devices, large
  // writes: ConnectionConfig::post_aside_bytes).
  uint64_t writes_posted_aside = 0;
  uint64_t credit_frames_sent = 0;
  // Credits granted to the peer beyond its first receives.
  uint64_t credits_granted = 0;
  // Frames posted without a completion of their own (selective
  // signaling), and the zero-length writes posted to complete them when
  // nothing signaled followed.
  uint64_t frames_unsignaled = 0;
  uint64_t flush_writes = 0;
  uint64_t waits_for_credit = 0;
  // Windows bound to grant landing memory, and landings registered for
  // their call alone (ChannelTransportStats::rdma_landing_windows and
  // rdma_landing_registrations).
  uint64_t landing_windows = 0;
  uint64_t landing_registrations = 0;
  // Grants that waited for windows their connection's other grants held
  // (ChannelTransportStats::rdma_landing_window_waits).
  uint64_t landing_window_waits = 0;
  // Times the channel's RDMA watcher (deadlines, progress) woke up.
  uint64_t watch_wakeups = 0;
  // Times a blocked caller found completions polling its connection's
  // (shared) completion queue itself.
  uint64_t caller_polls = 0;
  // Times the engine armed the connection's (shared) completion queue to
  // sleep until its next completion.
  uint64_t queue_arms = 0;
  // Callbacks run inline that held the completion thread for
  // kCompletionThreadStall or more.
  uint64_t callback_stalls = 0;
};

// A transport connected at run time that may be lost (RDMA).
class FastTransport : public ClientTransport {
 public:
  // OK while the connection is up; else why it went down.
  virtual Status health() const = 0;
  // "RDMA connection to 198.18.0.1:41234 (rxe0)", for stats and reasons.
  virtual const std::string& description() const = 0;
  virtual FastPathCounters counters() const = 0;
};

// What a connect attempt came to: a transport, or why not.
struct FastConnectResult {
  std::unique_ptr<FastTransport> transport;  // null: not connected
  Status error;                              // why not
  // This host or the server has no such path at all (no device, no
  // handshake method, the feature off, another wire version): trying
  // again will not help. Any other failure (refused, timed out, an address
  // in use) may pass.
  bool no_fast_path = false;
};

// The server's always-on port as a transport that sets up a faster path
// (the RDMA handshake) sees it: one request, one answer, serialized bytes.
class SetupChannel {
 public:
  virtual ~SetupChannel() = default;
  // Calls the runtime's own `method`; blocks up to `timeout`. UNIMPLEMENTED
  // when the server does not serve it.
  virtual StatusOr<std::string> UnaryBytes(
      const std::string& method, const std::string& request,
      std::chrono::milliseconds timeout) = 0;
};

// A method as the server knows it: the user's descriptor plus placement.
struct ServerMethod {
  MethodDescriptor descriptor;
  TensorPlacement placement;
  // Its handlers may block: they run on the worker pool even when the
  // server runs handlers inline (ServerBuilder::SetMethodBlocking).
  bool blocking = false;
  // How its handlers fared inline, kept by the threads that run them: once
  // one blocks in a call of ours, or they stall their thread often, they
  // run on the worker pool.
  struct InlineRecord {
    InlineRecord() = default;
    // Copied only while the server is built (the method table), unused.
    InlineRecord(const InlineRecord&) {}
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> stalls{0};
    std::atomic<bool> moved_to_workers{false};
  };
  mutable InlineRecord inline_record;
};

// The connection a logged call's response goes out on, as the call log
// sees it (see call_log.h).
class ResponsePath {
 public:
  virtual ~ResponsePath() = default;
  // The client re-sent a call whose response is going out here: it re-sends
  // only after it gave this connection up, so it will never read what is in
  // flight on it. Closes the connection, so that the transport reports the
  // responses it was sending as undelivered instead of waiting for the
  // wire's retries to fail.
  virtual void Abandon(const Status& why) = 0;
};

// Server-side state of one call, shared by the transport (which fills it
// and sends the result) and the dispatcher (which runs the handler).
class ServerCallState {
 public:
  ServerCallState(const ServerMethod* method, TransportKind transport)
      : method_(method), transport_(transport) {}

  const ServerMethod& method() const { return *method_; }
  TransportKind transport() const { return transport_; }
  // Shared by the connection's calls: a call copies no string.
  std::shared_ptr<const std::string> peer;
  // Calls of this call's connection admitted and not yet finished, shared
  // by the connection's calls (ServerBuilder::SetMaxCallsPerConnection);
  // null: not counted.
  std::shared_ptr<std::atomic<uint32_t>> connection_calls;
  uint64_t call_id = 0;
  // Non-zero for calls the client may re-send (every RDMA call, and the
  // re-sends themselves): the dispatcher runs them at most once per
  // (client_id, call_id); see call_log.h.
  uint64_t client_id = 0;
  // Set on a re-send: the server instance the call was first sent to; how
  // long after its first send the client sent this re-send (`age`, by the
  // client's clock); and when the re-send's first message (its head: the
  // metadata, the message and up to 16 KiB of tensor bytes) arrived here
  // (by CoarseSteadyNow, the call log's clock). `arrived - age` is when the
  // call was first sent, give or take that way: CallLog relies on it
  // taking under CallLog::kResendGrace, not on when the rest of the
  // request arrives.
  struct Resend {
    uint64_t server_instance = 0;
    std::chrono::milliseconds age{0};
    std::chrono::steady_clock::time_point arrived;
  };
  std::optional<Resend> resend;
  // Set by the dispatcher when the call went through its call log; the
  // transport then reports the response's fate (Dispatcher::Delivered).
  bool logged = false;
  // Set by a transport whose connection the client may give up while a
  // response is on it (RDMA); empty for one whose close it always sees.
  std::weak_ptr<ResponsePath> response_path;
  std::optional<std::chrono::system_clock::time_point> deadline;
  std::multimap<std::string, std::string> client_metadata;
  // Set by the handler (ServerContext::AddInitialMetadata, ...); the
  // transport sends them with the outcome once the handler returned.
  std::multimap<std::string, std::string> initial_metadata;
  std::multimap<std::string, std::string> trailing_metadata;
  CallTensors tensors;
  void* cuda_stream = nullptr;  // ServerContext::set_cuda_stream
  std::atomic<bool> cancelled{false};

 private:
  const ServerMethod* method_;
  TransportKind transport_;
};

// Runs handlers. Owned by the Server; transports call it.
class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // nullptr for an unknown path.
  virtual const ServerMethod* Find(std::string_view path) const = 0;
  // The path of every method it serves ("/package.Service/Method").
  virtual std::vector<std::string> MethodPaths() const = 0;
  virtual uint64_t max_request_tensor_bytes() const = 0;
  // Runs the handler for `state` on a worker with `request` (parsed, its
  // tensors bound in state->tensors). `done` runs exactly once with the
  // handler's status and response; with CANCELLED and no handler run when
  // the call was cancelled before a worker picked it up. The response may
  // live on the request's arena (its owner then holds the request's too).
  using Completion = std::function<void(
      Status, std::shared_ptr<google::protobuf::Message> response)>;
  // A call with a client_id whose handler already ran (or is running) is
  // not run again: `done` gets that run's outcome, or UNAVAILABLE.
  virtual void Execute(std::shared_ptr<ServerCallState> state,
                       std::shared_ptr<google::protobuf::Message> request,
                       Completion done) = 0;
  // For calls with a client_id, once the transport knows the response's
  // fate: it reached the client, or it could not be delivered (kept for a
  // re-send, with the state whose tensors it refers to).
  virtual void Delivered(const ServerCallState& state) = 0;
  virtual void Undelivered(
      std::shared_ptr<ServerCallState> state, Status status,
      std::shared_ptr<google::protobuf::Message> response) = 0;
  // Random per server start; the RDMA handshake hands it to clients.
  virtual uint64_t server_instance() const = 0;
};

class ServerTransport {
 public:
  virtual ~ServerTransport() = default;
  // Stops taking calls, cancels the ones still running at `deadline`, and
  // returns when all have completed.
  virtual void Shutdown(std::chrono::system_clock::time_point deadline) = 0;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_TRANSPORT_H_
