// rdmarpc/server.h: serving rdmarpc services.
//
// A generated `X::Service` derives from rdmarpc::Service; override its
// methods, register an instance with a ServerBuilder and start the server.
// Its gRPC port serves rdmarpc clients and stock gRPC clients alike.
//
//   class Impl final : public demo::Inference::Service {
//     rdmarpc::Status Run(rdmarpc::ServerContext* ctx, const demo::Req& req,
//                         demo::Resp* resp) override {
//       RDMARPC_ASSIGN_OR_RETURN(auto in, ctx->tensors().Get(req.input()));
//       return ctx->tensors().Set(resp->mutable_output(), in);  // echo
//     }
//   };
//   Impl impl;
//   int port = 0;
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("0.0.0.0:0", &port)
//                     .RegisterService(&impl)
//                     .BuildAndStart();
//   if (!server.ok()) ...;
//   (*server)->Wait();
//
// Handlers run on a pool of worker threads and may block; a long handler
// should poll ServerContext::IsCancelled().
#ifndef RDMARPC_SERVER_H_
#define RDMARPC_SERVER_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "google/protobuf/message.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/interceptor.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"

namespace rdmarpc {

namespace internal {
class ServerCallState;
class ServerDispatcher;
}  // namespace internal

// Per-call information and the call's tensors, for a handler. Owned by the
// runtime; valid until the handler returns. Tensor views taken from
// tensors() stay valid after that only through TensorView::buffer().
class ServerContext {
 public:
  ServerContext(const ServerContext&) = delete;
  ServerContext& operator=(const ServerContext&) = delete;

  const std::string& method() const;
  std::string peer() const;
  TransportKind transport() const;
  uint64_t call_id() const;
  std::optional<std::chrono::system_clock::time_point> deadline() const;
  // True once the client cancelled, the deadline passed or the server is
  // shutting down. The handler's result is then discarded.
  bool IsCancelled() const;
  const std::multimap<std::string, std::string>& client_metadata() const;

  // Sent to the client with the response, over either transport, with an
  // error status too: initial metadata ahead of the response, trailing
  // metadata after it, as gRPC sends them (a stock gRPC client sees them
  // as such; an rdmarpc client reads both once the call completes, from
  // ClientContext::GetServerInitialMetadata and GetServerTrailingMetadata).
  // The rules of ClientContext::AddMetadata apply: INVALID_ARGUMENT names a
  // key or value they refuse, RESOURCE_EXHAUSTED says when both sets
  // together pass 64 entries or 16 KiB; the entry is then not added. Call
  // them from the handler, before it returns.
  //
  //   RDMARPC_RETURN_IF_ERROR(ctx->AddTrailingMetadata("x-cache", "hit"));
  Status AddInitialMetadata(std::string key, std::string value);
  Status AddTrailingMetadata(std::string key, std::string value);

  // Received request tensors (Get) and response tensors to send (Set).
  // Buffers bound with Set are borrowed until the response has been sent,
  // which is after the handler returns: bind owned or shared buffers.
  CallTensors& tensors();

  // The CUDA stream (a cudaStream_t; nullptr is the legacy default stream)
  // that produced the response's device tensors: the runtime reads them
  // after the work queued on it before the handler returned. Without it,
  // after the work queued on the legacy default stream. Request tensors are
  // in place before the handler runs.
  void set_cuda_stream(void* stream);

 private:
  friend class internal::ServerDispatcher;  // the runtime makes them
  explicit ServerContext(internal::ServerCallState* state) : state_(state) {}
  Status AddResponseMetadata(std::multimap<std::string, std::string>* to,
                             std::string key, std::string value);

  internal::ServerCallState* state_;
};

// A unary method: request and response types plus the code that serves it.
struct MethodDescriptor {
  std::string path;  // "/package.Service/Method"
  const google::protobuf::Message* request_prototype;
  const google::protobuf::Message* response_prototype;
  std::function<Status(ServerContext*, const google::protobuf::Message&,
                       google::protobuf::Message*)>
      handler;
};

// Base of every generated Service.
class Service {
 public:
  Service() = default;
  // Registered handlers point at this object.
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;
  virtual ~Service() = default;
  const std::vector<MethodDescriptor>& methods() const { return methods_; }

 protected:
  // Used by generated code: registers `path` with typed request/response.
  template <typename Request, typename Response, typename Fn>
  void AddUnaryMethod(std::string path, Fn fn) {
    methods_.push_back(MethodDescriptor{
        std::move(path), &Request::default_instance(),
        &Response::default_instance(),
        [fn = std::move(fn)](ServerContext* ctx,
                             const google::protobuf::Message& req,
                             google::protobuf::Message* resp) {
          return fn(ctx, static_cast<const Request&>(req),
                    static_cast<Response*>(resp));
        }});
  }

 private:
  std::vector<MethodDescriptor> methods_;
};

// What a server's RDMA side has done; see Server::rdma_stats().
struct RdmaServerStats {
  // "listening on 198.18.0.1:41234 (rxe0)", or why there is no RDMA.
  std::string status;
  uint64_t connections_accepted = 0;
  // Of those, the ones that share a protection domain with the other
  // connections of their completion queue (where the device has type-2
  // memory windows and the process no GPU; RDMARPC_RDMA_SHARED_DOMAINS=0
  // gives each its own).
  uint64_t connections_in_shared_domains = 0;
  // Of those, the ones whose receives come from their completion queue's
  // shared receive queue (RDMARPC_RDMA_SHARED_RECEIVES=0: none), so that
  // control buffers grow with the credits clients use, not with
  // connections.
  uint64_t connections_with_shared_receives = 0;
  // Connect requests without a valid one-time token from the handshake.
  uint64_t connects_refused = 0;
  // Connections closed because the peer broke the protocol.
  uint64_t protocol_errors = 0;
  // Memory windows bound to grant request landings: one per request over
  // the block its host landings share (of the landing arena, or of its
  // own when the arena is off or full), one more per other landing (a GPU
  // staging buffer); none where the device has no type-2 windows.
  uint64_t landing_windows = 0;
  // Registrations made for one request (pinning its pages per call): its
  // block where that is not in an arena segment this connection has
  // registered (one for all of its host landings), and each other
  // landing.
  uint64_t landing_registrations = 0;
  // Requests whose grant waited for windows the connection's other grants
  // held (each connection has 32), rather than registering their landings
  // for remote write.
  uint64_t landing_window_waits = 0;
};

// What the call log that makes re-sent calls run once has done, over both
// transports; see Server::call_log_stats().
struct CallLogStats {
  // Records held now.
  uint64_t calls_logged = 0;
  // Repeats answered from a record without running the handler.
  uint64_t repeats_answered = 0;
  // Repeats refused because the log could not tell whether the call ran.
  uint64_t repeats_refused = 0;
};

// What became of the calls handed to handlers, over both transports; see
// Server::handler_stats(). Repeats answered from the call log count in
// none of these.
struct HandlerStats {
  // Handlers started.
  uint64_t started = 0;
  // Calls not started because they were cancelled while they queued.
  uint64_t not_started_cancelled = 0;
  // Calls not started because their deadline passed while they queued
  // (they end DEADLINE_EXCEEDED).
  uint64_t not_started_past_deadline = 0;
  // Handlers run inline (ServerBuilder::SetRunHandlersInline) that held
  // the receiving thread for 1 ms or more. Each one stalled every
  // connection that thread serves: mark their methods with
  // ServerBuilder::SetMethodBlocking.
  uint64_t inline_stalls = 0;
  // Methods whose handlers ran inline until one blocked in a blocking call
  // or they stalled their thread often (SetRunHandlersInline), and that
  // run on the worker pool since.
  uint64_t moved_to_workers = 0;
  // Calls refused with RESOURCE_EXHAUSTED because their connection had
  // ServerBuilder::SetMaxCallsPerConnection calls running.
  uint64_t over_connection_limit = 0;
};

class Server;
namespace internal {
class ServerTransport;
}  // namespace internal

// TLS on the server's gRPC port (ServerBuilder::UseTls). PEM text.
struct TlsServerCredentials {
  std::string cert_chain_pem;
  std::string private_key_pem;
  // Mutual TLS: CAs that sign the client certificates to accept, and
  // whether a client must present one. A client the TLS handshake refuses
  // can neither call nor get an RDMA token (the handshake runs over this
  // port), so it cannot obtain a queue pair either.
  std::string client_ca_pem;
  bool require_client_cert = false;
};

class ServerBuilder {
 public:
  ServerBuilder();
  ~ServerBuilder();

  // Listens for gRPC, plain and rdmarpc's own, and RDMA handshakes on `address`
  // ("0.0.0.0:50051", "[::]:50051"; port 0 picks a free one). `selected_port`,
  // if given, receives the bound port once BuildAndStart() returns. A
  // malformed address makes BuildAndStart() fail with INVALID_ARGUMENT
  // naming what is wrong.
  ServerBuilder& AddListeningPort(std::string address,
                                  int* selected_port = nullptr);

  // Whether another process (or server) may listen on the same port, the
  // kernel spreading connections over them (SO_REUSEPORT). Default: no, so
  // a port already in use makes BuildAndStart() fail instead of silently
  // sharing it.
  ServerBuilder& SetPortReuse(bool reuse);

  // Serves the gRPC port (and so the RDMA handshake) over TLS, mutual when
  // `tls.require_client_cert`. RDMA traffic itself is not encrypted (no
  // RDMA NIC encrypts by default): a queue pair is only granted to a client
  // that passed the TLS handshake, and tensor memory is only reachable
  // through per-call grants on that queue pair.
  ServerBuilder& UseTls(TlsServerCredentials tls);

  // Lets clients send keepalive pings (ChannelOptions::keepalive_time) as
  // often as every `min_interval`, with or without calls in flight. By
  // default the server follows gRPC: a client pinging more often than every
  // 5 minutes is closed with "too_many_pings".
  ServerBuilder& SetKeepalivePermit(std::chrono::milliseconds min_interval);

  // Serves the standard health service (grpc.health.v1.Health) on the gRPC
  // port. Default: yes. The server and each registered service report
  // SERVING until shutdown (then NOT_SERVING); Server::SetServingStatus
  // changes that, e.g. to drain a replica before stopping it. Health checks
  // are answered on the gRPC port's threads (SetGrpcThreads), so one waits
  // while inline handlers hold all of them (10-110 ms, until the port's
  // watchdog adds a thread).
  ServerBuilder& SetHealthService(bool enable);

  // Serves gRPC server reflection (grpc.reflection.v1 and v1alpha) on the
  // gRPC port, so that grpcurl or a generated reflection client can list
  // the services and fetch their .proto descriptors. Default: no, as in
  // gRPC: it shows every message type linked into the program.
  ServerBuilder& EnableReflection(bool enable);

  // Runs `interceptor` around every handler (rdmarpc/interceptor.h), after
  // those added before it.
  ServerBuilder& AddInterceptor(std::shared_ptr<ServerInterceptor> interceptor);

  // Registers `service`; it must outlive the server. The same method path
  // registered twice makes BuildAndStart() fail.
  ServerBuilder& RegisterService(Service* service);

  // Worker threads that run handlers (default: max(4, hardware threads)).
  // A handler there may make blocking calls (Channel::Call, the generated
  // blocking stubs), into this server too: while workers wait in them, the
  // pool starts threads for the handlers queued meanwhile, so that n
  // threads stay outside calls; a thread beyond n leaves after a second
  // without a handler. Waiting on a CallFuture's future holds its worker.
  ServerBuilder& SetNumWorkers(int n);

  // Threads that poll the gRPC port and run each step of its calls (and
  // inline handlers of calls over gRPC). Default 1, the cheapest per call:
  // gRPC lets one thread at a time wait on its sockets, so every further
  // polling thread adds futex wake-ups to each call (a second one: about
  // 3 more per small call, measured). Raise it when the gRPC side of a
  // busy server needs more than one core. At most 64; n <= 0: the default.
  ServerBuilder& SetGrpcThreads(int n);

  // Where received request tensors land: the default for every method, for
  // one method path, or for the tensors under one top-level field of one
  // method's request (the most specific setting wins). Default: the
  // server's first GPU when it has a usable one, else host memory.
  //
  //   builder.SetTensorPlacement(rdmarpc::Device::Cuda(1))
  //       .SetFieldTensorPlacement("/demo.Infer/Run", "debug_image",
  //                                rdmarpc::Device::Host());
  ServerBuilder& SetTensorPlacement(Device device);
  ServerBuilder& SetMethodTensorPlacement(std::string method_path,
                                          Device device);
  ServerBuilder& SetFieldTensorPlacement(std::string method_path,
                                         std::string field_name, Device device);

  // How RDMA reaches request and response tensors in GPU memory (see
  // GpuRdmaMode in rdmarpc/memory.h). Default kAuto.
  ServerBuilder& SetGpuRdmaMode(GpuRdmaMode mode);

  // Limits, each with a clear error when reached:
  //
  // A request whose tensors add up to more than this fails with
  // RESOURCE_EXHAUSTED before any landing memory is allocated. Default
  // 64 GiB. (The client's own limit on responses is
  // ChannelOptions::max_response_tensor_bytes.)
  ServerBuilder& SetMaxRequestTensorBytes(uint64_t bytes);
  // Calls one connection (one RDMA connection, or one gRPC TCP connection)
  // may have running at once, counted from arrival until the handler's
  // outcome; one more fails with RESOURCE_EXHAUSTED naming the limit.
  // Repeats answered from the call log are not counted. Default 1024.
  ServerBuilder& SetMaxCallsPerConnection(uint32_t calls);
  // RDMA connections the server holds at once (each registers 4 MiB of
  // control buffers, and locked memory may be limited: `rdmarpc doctor`).
  // A client over the limit is told so in the handshake and carries its
  // calls over gRPC, with that reason in CallStats; a channel created later
  // asks again. Default 256.
  ServerBuilder& SetMaxRdmaConnections(uint32_t connections);
  // How long after a logged call (an RDMA call, or its re-send over gRPC)
  // was first sent the server still answers its re-send from the call's
  // record rather than run it a second time: a client re-sends a call
  // after its RDMA connection failed. A re-send sent later, or one whose
  // request (with its tensors) arrives whole later, is refused with
  // UNAVAILABLE saying the call may have run: keep the window longer than
  // the calls' deadlines and the time a re-send of the largest request
  // takes to upload. Each record is kept 2 s longer than the window, for
  // the re-send's header's way to the server. The log holds at most
  // SetCallLogMaxRecords records (dropping the oldest settled ones first),
  // so a shorter window also holds fewer at high call rates. From 1 s to
  // 24 h; default 30 s.
  ServerBuilder& SetCallLogWindow(std::chrono::milliseconds window);
  // How many records the call log holds at most (default 262144, from 1024
  // to 16777216); a record takes about 150 to 300 bytes. Past that the
  // oldest settled records go before their window ends, and a re-send the
  // log does not know, first sent no later than 2 s after the newest of
  // them was logged, is refused with UNAVAILABLE saying the call may have
  // run (a log that fills in under 2 s refuses every such re-send). Keep
  // it above the calls a window brings: a server taking 100k logged calls
  // a second fills 262144 in under 3 s of a 30 s window. Calls still
  // running are kept whatever the limit.
  ServerBuilder& SetCallLogMaxRecords(size_t records);

  // Whether to take RDMA connections (default: yes, when this host has an
  // RDMA device with an ACTIVE port; clients are told why not otherwise).
  ServerBuilder& EnableRdma(bool enable);
  // Control receives per RDMA connection (at least 4; default 64): how many
  // frames a client may have in flight before it waits for credits. A
  // client starts with 16 of them (or all, if fewer) and is granted the
  // rest as it runs low, as far as the receives backing them allow (a
  // shared receive queue's spare; docs/design.md, "Flow control").
  ServerBuilder& SetRdmaReceives(uint32_t receives);
  // Landing memory granted to RDMA requests at once (default 8 GiB). A
  // request that would exceed it is not run over RDMA: the client sends it
  // over gRPC instead, with the reason in its CallStats.
  ServerBuilder& SetRdmaLandingPoolBytes(uint64_t bytes);

  // Where handlers run. By default on the thread that received the call,
  // with no hand-off (the lowest latency): over RDMA, the completion
  // engine, after the batch of completions that delivered the call; over
  // gRPC, the gRPC thread that read it. That suits handlers that finish in
  // microseconds and do not block (no I/O, no sleeping, no waiting on
  // locks held by slow code or on other calls). Mark a method that may
  // block with SetMethodBlocking, or turn inline handlers off for the
  // whole server (SetRunHandlersInline(false)): those handlers run on the
  // worker pool (SetNumWorkers).
  //
  // A handler that blocks anyway is contained, not fatal: a blocking
  // Channel::Call or a CallFuture made in it hands the RDMA engine to
  // another thread first, and its method runs on the worker pool from then
  // on; one that holds the engine 10-20 ms loses it to another thread. A
  // handler that holds its thread 1 ms or more counts in
  // HandlerStats::inline_stalls (RDMARPC_INLINE_STALL_US sets another
  // threshold, for profilers); after 8 such stalls, if they are at least 1
  // in 16 of its calls, the method runs on the worker pool too
  // (HandlerStats::moved_to_workers). Until then the other connections of
  // that thread wait. Over gRPC, once every thread of the port
  // (SetGrpcThreads) has been in the same step of a call for 10-110 ms, the
  // port's watchdog starts another thread, and the one it replaced leaves
  // when its handler returns.
  ServerBuilder& SetRunHandlersInline(bool run_inline);
  // Marks one method ("/package.Service/Method") as one whose handler may
  // block: its handlers run on the worker pool. Unknown methods fail
  // BuildAndStart with INVALID_ARGUMENT.
  //
  //   builder.SetMethodBlocking("/store.Store/LoadFromDisk");
  ServerBuilder& SetMethodBlocking(std::string method_path);

  // Starts serving. INVALID_ARGUMENT for a bad configuration or address,
  // UNAVAILABLE if the port cannot be bound (the message says why, e.g.
  // "address already in use").
  StatusOr<std::unique_ptr<Server>> BuildAndStart();

 private:
  std::vector<std::pair<std::string, int*>> ports_;
  bool port_reuse_ = false;
  std::optional<TlsServerCredentials> tls_;
  std::chrono::milliseconds keepalive_permit_{0};
  bool health_service_ = true;
  bool reflection_ = false;
  std::vector<Service*> services_;
  std::vector<std::shared_ptr<ServerInterceptor>> interceptors_;
  int workers_ = 0;
  int grpc_threads_ = 1;
  std::optional<Device> placement_;
  std::map<std::string, Device> method_placement_;
  std::map<std::pair<std::string, std::string>, Device> field_placement_;
  GpuRdmaMode gpu_rdma_mode_ = GpuRdmaMode::kAuto;
  uint64_t max_request_tensor_bytes_ = uint64_t{64} << 30;
  uint32_t max_calls_per_connection_ = 1024;
  uint32_t max_rdma_connections_ = 256;
  std::chrono::milliseconds call_log_window_{30000};
  size_t call_log_max_records_ = size_t{1} << 18;
  bool rdma_ = true;
  uint32_t rdma_receives_ = 64;
  uint64_t rdma_landing_pool_bytes_ = uint64_t{8} << 30;
  bool handlers_inline_ = true;
  std::set<std::string> blocking_methods_;
};

class Server {
 public:
  ~Server();  // Shutdown() with no grace period, then waits.
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Stops accepting calls; calls still running at `deadline` are cancelled
  // (their clients get CANCELLED or UNAVAILABLE). Returns when every handler
  // has returned and every call has completed. Idempotent.
  //
  // Called from one of this server's handlers (a "Quit" method), it cannot
  // wait for that handler's own call: it starts the shutdown on a thread
  // of its own and returns at once. The handler's call completes as usual
  // (within `deadline`), and Wait() returns once the shutdown is done.
  // Wait() and the destructor still wait for every call: neither may be
  // called from a handler.
  void Shutdown(std::chrono::system_clock::time_point deadline);
  void Shutdown() { Shutdown(std::chrono::system_clock::now()); }

  // Blocks until Shutdown() has completed (from another thread).
  void Wait();

  // What the health service reports for `service` ("demo.Inference"); an
  // empty name sets the server and every service at once. NOT_FOUND for a
  // service the server does not run, FAILED_PRECONDITION without a health
  // service or once shutdown has begun.
  Status SetServingStatus(const std::string& service, bool serving);

  // The RDMA transport's counters, the call log's and the handlers'. Once
  // shut down, the call log's and the handlers' read as the shutdown left
  // them.
  RdmaServerStats rdma_stats() const;
  CallLogStats call_log_stats() const;
  HandlerStats handler_stats() const;

 private:
  friend class ServerBuilder;
  Server();
  // Shutdown's work: waits for the transports, then ends the dispatcher.
  void FinishShutdown(std::chrono::system_clock::time_point deadline);
  CallLogStats CallLogStatsLocked() const;  // mu_ held

  std::unique_ptr<internal::ServerDispatcher> dispatcher_;
  std::vector<std::unique_ptr<internal::ServerTransport>> transports_;
  std::function<RdmaServerStats()> rdma_stats_;
  std::set<std::string> service_names_;
  std::function<Status(const std::string&, bool)> set_serving_status_;
  // Guards dispatcher_'s end against the stats that read it, and the
  // shutdown's state below.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  CallLogStats final_call_log_stats_;  // set as the dispatcher ends
  HandlerStats final_handler_stats_;
  bool shutdown_started_ = false;
  bool shutdown_done_ = false;
  // Runs the shutdown a handler started (set under mu_).
  std::thread shutdown_thread_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_SERVER_H_
