// rdmarpc/channel.h: a client's connection to one server.
//
// A Channel picks, per call, the transport that carries it, according to its
// TransportPolicy and the health of its RDMA connection, and records the
// choice and the reason in the call's CallStats. Generated stubs call it;
// users create it and pass it to `Service::NewStub`.
//
// RDMA health (policy auto or rdma; docs/design.md has the diagram):
//   connecting -> rdma-ready: the handshake and connect worked;
//   connecting -> grpc-only:  this host or the server has no RDMA at all;
//   connecting, rdma-ready -> degraded: the connect failed, or the
//     connection broke (completion error, QP/port/device event, device
//     removed, server silent on RDMA). Calls go over gRPC while a
//     background probe retries RDMA with exponential backoff and jitter;
//   degraded -> rdma-ready: a probe connected; new calls use RDMA again.
// Calls in flight when the connection broke are re-sent over gRPC with the
// same call id; the server runs each at most once (its call log), and a
// call that cannot complete either way fails with UNAVAILABLE naming both
// attempts. Every callback runs exactly once.
//
//   auto channel = rdmarpc::CreateChannel("10.0.0.7:50051");
//   auto stub = demo::Inference::NewStub(channel);
//
// A Channel is thread-safe; share one between threads and stubs.
#ifndef RDMARPC_CHANNEL_H_
#define RDMARPC_CHANNEL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "google/protobuf/message.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/status.h"

namespace rdmarpc {

enum class TransportPolicy {
  kAuto,  // RDMA when both sides can, else gRPC (the default)
  kRdma,  // RDMA only: calls fail with UNAVAILABLE when it cannot be used
  kGrpc,  // gRPC only
};
const char* PolicyName(TransportPolicy policy);  // "auto", "rdma", "grpc"
// Parses "auto", "rdma" or "grpc".
StatusOr<TransportPolicy> ParsePolicy(std::string_view name);

struct ChannelOptions {
  TransportPolicy policy = TransportPolicy::kAuto;
  // Out-of-band tensor bytes on the gRPC transport go in chunks of this size.
  size_t grpc_chunk_bytes = size_t{1} << 20;
  // A response whose tensors add up to more than this fails with
  // RESOURCE_EXHAUSTED instead of allocating landing memory for them.
  uint64_t max_response_tensor_bytes = uint64_t{64} << 30;
  // Handshake plus RDMA connect, before 'auto' settles for gRPC (and calls
  // made meanwhile wait for the outcome).
  std::chrono::milliseconds rdma_connect_timeout{5000};
  // Request tensors up to this size go inside the RDMA SEND (when they fit
  // the server's receive buffers) instead of by RDMA WRITE. 0: the
  // threshold the server advertises.
  uint64_t rdma_inline_threshold = 0;
  // With calls outstanding, a server silent on RDMA this long is taken for
  // gone (it is pinged after a third of it): the connection is dropped and
  // its calls re-sent over gRPC. Bounds how long a call waits on a peer
  // whose RDMA side stopped while its gRPC port answers. 0: never.
  std::chrono::milliseconds rdma_peer_timeout{3000};
  // Degraded: the first probe waits this long, then each wait doubles up
  // to the maximum; every wait is jittered by +-25%.
  std::chrono::milliseconds rdma_probe_initial_backoff{100};
  std::chrono::milliseconds rdma_probe_max_backoff{5000};

  // How RDMA reaches tensors in GPU memory (see GpuRdmaMode in
  // rdmarpc/memory.h); CallStats::gpu_rdma_mode says what each call used.
  GpuRdmaMode gpu_rdma_mode = GpuRdmaMode::kAuto;
};

// A channel's RDMA health; see the diagram at the top of this file.
enum class RdmaHealth {
  kNotTried,    // no call yet
  kConnecting,  // first handshake in progress; calls wait for it
  kReady,       // calls go over RDMA
  kDegraded,    // calls go over gRPC; a probe retries RDMA in the background
  kGrpcOnly,    // no RDMA possible (policy grpc, or a side without RDMA)
};
// "not-tried", "connecting", "rdma-ready", "degraded", "grpc-only".
const char* RdmaHealthName(RdmaHealth health);

// How a channel's transports are doing; see Channel::transport_stats().
struct ChannelTransportStats {
  RdmaHealth health = RdmaHealth::kNotTried;
  // "ready: RDMA connection to 198.18.0.1:41234 (rxe0)", "connecting",
  // "not tried yet", or why RDMA is not used.
  std::string rdma;
  // Times new calls moved from RDMA to gRPC or back.
  uint64_t switches = 0;
  // What last took RDMA away ("work-completion error", "port error event",
  // "device removed", "server silent on RDMA", "connect failed", ...) and
  // its error text; empty while nothing has.
  std::string last_trigger;
  std::string last_error;
  // Probes made while degraded, and the last one's error.
  uint64_t probes = 0;
  std::string last_probe_error;
  // Calls started over each transport (a re-send counts on gRPC too), and
  // calls re-sent over gRPC after their RDMA connection failed.
  uint64_t calls_rdma = 0;
  uint64_t calls_grpc = 0;
  uint64_t calls_resent = 0;
  // One line per field, for logs and the example's --verbose.
  std::string ToString() const;
  // The RDMA connection's frames, writes, credit-only frames, and how
  // often a frame or write had to wait for the peer's credits.
  uint64_t rdma_frames_sent = 0;
  uint64_t rdma_frames_received = 0;
  uint64_t rdma_writes_posted = 0;
  uint64_t rdma_credit_frames_sent = 0;
  uint64_t rdma_waits_for_credit = 0;
};

namespace internal {
class ClientTransport;
struct ClientCall;
}  // namespace internal
namespace rdma {
class RdmaClientTransport;
struct RdmaConnectResult;
}  // namespace rdma
namespace grpc_transport {
class GrpcClientTransport;
}  // namespace grpc_transport

class Channel {
 public:
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const std::string& target() const { return target_; }
  const ChannelOptions& options() const { return options_; }

  // Calls `method` ("/package.Service/Method"). The request, response,
  // context and the buffers bound in ctx->tensors() are borrowed until the
  // call completes: `done` runs exactly once, on a runtime thread, after
  // which the response (and ctx->tensors().Get() on its tensors) is ready.
  void CallAsync(std::string_view method, ClientContext* ctx,
                 const google::protobuf::Message& request,
                 google::protobuf::Message* response,
                 std::function<void(Status)> done);

  // Blocking form of CallAsync.
  Status Call(std::string_view method, ClientContext* ctx,
              const google::protobuf::Message& request,
              google::protobuf::Message* response);

  ChannelTransportStats transport_stats();

  // Future form of CallAsync: the future becomes ready when the call
  // completes. The borrowed objects must outlive that moment.
  std::future<Status> CallFuture(std::string_view method, ClientContext* ctx,
                                 const google::protobuf::Message& request,
                                 google::protobuf::Message* response);

 private:
  friend std::shared_ptr<Channel> CreateChannel(std::string target,
                                                ChannelOptions options);
  Channel(std::string target, ChannelOptions options);
  // Hands `call` to the transport the policy and the RDMA health pick.
  // CallAsync's body; `done_runs_inline`: see internal::ClientCall.
  void StartCall(std::string_view method, ClientContext* ctx,
                 const google::protobuf::Message& request,
                 google::protobuf::Message* response,
                 std::function<void(Status)> done, bool done_runs_inline);
  void Route(internal::ClientCall call);
  // Sends `call` over gRPC (or fails it under policy rdma); `why` goes in
  // its stats and, should gRPC fail too, in its status.
  void SendOverGrpc(internal::ClientCall call, std::string why);
  // The RDMA thread: the first connect, then probes while degraded.
  void RdmaLoop();
  // Runs on the engine thread when `transport`'s connection broke.
  void OnRdmaLost(const rdma::RdmaClientTransport* transport, const Status& why,
                  const std::string& trigger);
  // rdma-ready -> degraded. Requires mu_.
  void MarkRdmaLostLocked(const Status& why, const std::string& trigger);
  rdma::RdmaConnectResult ConnectRdma();

  std::string target_;
  ChannelOptions options_;
  std::unique_ptr<grpc_transport::GrpcClientTransport> grpc_;
  std::atomic<uint64_t> next_call_id_{1};
  const uint64_t client_id_;  // random; names this channel's calls

  std::mutex mu_;
  std::condition_variable cv_;
  RdmaHealth health_ = RdmaHealth::kNotTried;
  std::string rdma_reason_;  // why RDMA is not used (degraded, grpc-only)
  std::shared_ptr<rdma::RdmaClientTransport> rdma_;
  // Broken transports, destroyed by the RDMA thread.
  std::vector<std::shared_ptr<rdma::RdmaClientTransport>> retired_;
  std::vector<internal::ClientCall> waiting_;  // while kConnecting
  ChannelTransportStats counts_;               // switches, triggers, probes
  std::atomic<uint64_t> calls_rdma_{0};
  std::atomic<uint64_t> calls_grpc_{0};
  std::atomic<uint64_t> calls_resent_{0};
  bool stopping_ = false;
  std::thread rdma_thread_;
};

// Creates a channel to `target` ("host:port", "[v6]:port", "unix:path").
// Connecting is lazy: errors surface on the first call.
std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options = {});

}  // namespace rdmarpc

#endif  // RDMARPC_CHANNEL_H_
