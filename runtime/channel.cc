#include "rdmarpc/channel.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/transport.h"
#include "transport/grpc/grpc_client.h"

namespace rdmarpc {

const char* PolicyName(TransportPolicy policy) {
  switch (policy) {
    case TransportPolicy::kAuto:
      return "auto";
    case TransportPolicy::kRdma:
      return "rdma";
    case TransportPolicy::kGrpc:
      return "grpc";
  }
  return "unknown";
}

StatusOr<TransportPolicy> ParsePolicy(std::string_view name) {
  if (name == "auto") return TransportPolicy::kAuto;
  if (name == "rdma") return TransportPolicy::kRdma;
  if (name == "grpc") return TransportPolicy::kGrpc;
  return absl::InvalidArgumentError(absl::StrCat("unknown transport policy '",
                                                 std::string(name),
                                                 "' (use auto, rdma or grpc)"));
}

Channel::Channel(std::string target, ChannelOptions options)
    : target_(std::move(target)),
      options_(options),
      grpc_(std::make_unique<grpc_transport::GrpcClientTransport>(target_,
                                                                  options_)) {}

Channel::~Channel() = default;

std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options) {
  return std::shared_ptr<Channel>(new Channel(std::move(target), options));
}

void Channel::CallAsync(std::string_view method, ClientContext* ctx,
                        const google::protobuf::Message& request,
                        google::protobuf::Message* response,
                        std::function<void(Status)> done) {
  if (!ctx->MarkStarted()) {
    done(absl::FailedPreconditionError(
        "ClientContext used for a second call; use one per call"));
    return;
  }
  CallStats* stats = ctx->mutable_stats();
  stats->call_id = next_call_id_.fetch_add(1);
  switch (options_.policy) {
    case TransportPolicy::kRdma:
      stats->transport_reason =
          "policy 'rdma' requires the RDMA transport, which this build does "
          "not have yet";
      done(absl::UnavailableError(absl::StrCat(
          "call ", std::string(method), " not sent: ", stats->transport_reason,
          "; use policy 'auto' or 'grpc'")));
      return;
    case TransportPolicy::kGrpc:
      stats->transport_reason = "policy 'grpc'";
      break;
    case TransportPolicy::kAuto:
      stats->transport_reason =
          "policy 'auto': no RDMA transport in this build, gRPC carries the "
          "call";
      break;
  }
  stats->transport = grpc_->kind();
  if (ctx->IsCancelled()) {
    done(absl::CancelledError("call cancelled before start"));
    return;
  }
  internal::ClientCall call;
  call.method = std::string(method);
  call.ctx = ctx;
  call.request = &request;
  call.response = response;
  call.call_id = stats->call_id;
  call.max_response_tensor_bytes = options_.max_response_tensor_bytes;
  call.done = std::move(done);
  grpc_->Start(std::move(call));
}

Status Channel::Call(std::string_view method, ClientContext* ctx,
                     const google::protobuf::Message& request,
                     google::protobuf::Message* response) {
  return CallFuture(method, ctx, request, response).get();
}

std::future<Status> Channel::CallFuture(
    std::string_view method, ClientContext* ctx,
    const google::protobuf::Message& request,
    google::protobuf::Message* response) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  CallAsync(method, ctx, request, response,
            [promise](Status s) { promise->set_value(std::move(s)); });
  return future;
}

}  // namespace rdmarpc
