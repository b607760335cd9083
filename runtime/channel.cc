#include "rdmarpc/channel.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/random.h"
#include "runtime/transport.h"
#include "runtime/transport_router.h"
#include "transport/grpc/grpc_client.h"
#include "transport/rdma/rdma_client.h"

namespace rdmarpc {

Channel::Channel(std::string target, ChannelOptions options)
    : target_(std::move(target)), options_(options) {
  auto grpc =
      std::make_unique<grpc_transport::GrpcClientTransport>(target_, options_);
  internal::SetupChannel* setup = grpc.get();
  grpc_ = std::move(grpc);
  router_ = std::make_unique<internal::TransportRouter>(
      options_, internal::RandomNonZero(), grpc_.get(),
      [setup, options = options_](internal::FastPathHooks hooks) {
        return rdma::RdmaClientTransport::Connect(setup, options,
                                                  std::move(hooks));
      });
}

// The router first: its fast transports re-send through the gRPC one.
Channel::~Channel() { router_.reset(); }

ChannelTransportStats Channel::transport_stats() { return router_->stats(); }

std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options) {
  return std::shared_ptr<Channel>(new Channel(std::move(target), options));
}

void Channel::CallAsync(std::string_view method, ClientContext* ctx,
                        const google::protobuf::Message& request,
                        google::protobuf::Message* response,
                        std::function<void(Status)> done) {
  StartCall(method, ctx, request, response, std::move(done),
            /*done_runs_inline=*/false);
}

void Channel::StartCall(std::string_view method, ClientContext* ctx,
                        const google::protobuf::Message& request,
                        google::protobuf::Message* response,
                        std::function<void(Status)> done,
                        bool done_runs_inline) {
  if (!internal::ClientContextAccess::MarkStarted(ctx)) {
    done(absl::FailedPreconditionError(
        "ClientContext used for a second call; use one per call"));
    return;
  }
  CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
  stats->call_id = next_call_id_.fetch_add(1);
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
  call.done_runs_inline = done_runs_inline;
  router_->Route(std::move(call));
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
  // Setting the promise only wakes the waiter: no hand-off to the callback
  // thread needed.
  StartCall(
      method, ctx, request, response,
      [promise](Status s) { promise->set_value(std::move(s)); },
      /*done_runs_inline=*/true);
  return future;
}

}  // namespace rdmarpc
