// rdmarpc/channel.h: a client's connection to one server.
//
// A Channel picks, per call, the transport that carries it, according to its
// TransportPolicy, and records the choice and the reason in the call's
// CallStats. Generated stubs call it; users create it and pass it to
// `Service::NewStub`.
//
//   auto channel = rdmarpc::CreateChannel("10.0.0.7:50051");
//   auto stub = demo::Inference::NewStub(channel);
//
// A Channel is thread-safe; share one between threads and stubs.
#ifndef RDMARPC_CHANNEL_H_
#define RDMARPC_CHANNEL_H_

#include <atomic>
#include <chrono>
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
};

// How a channel's transports are doing; see Channel::transport_stats().
struct ChannelTransportStats {
  // "ready: RDMA connection to 198.18.0.1:41234 (rxe0)", "connecting",
  // "not tried yet", or why RDMA is not used.
  std::string rdma;
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
  // Hands `call` to the transport the policy and the RDMA state pick.
  void Route(internal::ClientCall call);
  void ConnectRdma();

  enum class RdmaState { kUnknown, kConnecting, kReady, kUnavailable };

  std::string target_;
  ChannelOptions options_;
  std::unique_ptr<grpc_transport::GrpcClientTransport> grpc_;
  std::atomic<uint64_t> next_call_id_{1};

  std::mutex mu_;
  RdmaState rdma_state_ = RdmaState::kUnknown;
  std::string rdma_reason_;  // why RDMA is not used (kUnavailable)
  std::unique_ptr<rdma::RdmaClientTransport> rdma_;
  std::vector<internal::ClientCall> waiting_;  // while kConnecting
  std::thread connector_;
};

// Creates a channel to `target` ("host:port", "[v6]:port", "unix:path").
// Connecting is lazy: errors surface on the first call.
std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options = {});

}  // namespace rdmarpc

#endif  // RDMARPC_CHANNEL_H_
