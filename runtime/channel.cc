#include "rdmarpc/channel.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/transport.h"
#include "transport/grpc/grpc_client.h"
#include "transport/rdma/rdma_client.h"

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

Channel::~Channel() {
  if (connector_.joinable()) connector_.join();
  // Calls still on RDMA fail with UNAVAILABLE; then gRPC goes.
  rdma_.reset();
}

std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options) {
  return std::shared_ptr<Channel>(new Channel(std::move(target), options));
}

void Channel::ConnectRdma() {
  auto connected = rdma::RdmaClientTransport::Connect(grpc_.get(), options_);
  std::vector<internal::ClientCall> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connected.ok()) {
      rdma_ = *std::move(connected);
      rdma_state_ = RdmaState::kReady;
    } else {
      rdma_state_ = RdmaState::kUnavailable;
      rdma_reason_ = std::string(connected.status().message());
    }
    waiting.swap(waiting_);
  }
  for (auto& call : waiting) Route(std::move(call));
}

ChannelTransportStats Channel::transport_stats() {
  ChannelTransportStats stats;
  std::lock_guard<std::mutex> lock(mu_);
  switch (rdma_state_) {
    case RdmaState::kUnknown:
      stats.rdma = "not tried yet";
      break;
    case RdmaState::kConnecting:
      stats.rdma = "connecting";
      break;
    case RdmaState::kUnavailable:
      stats.rdma = rdma_reason_;
      break;
    case RdmaState::kReady:
      stats.rdma = absl::StrCat("ready: ", rdma_->description());
      break;
  }
  if (rdma_) {
    rdma::Connection::Counters c = rdma_->counters();
    stats.rdma_frames_sent = c.frames_sent;
    stats.rdma_frames_received = c.frames_received;
    stats.rdma_writes_posted = c.writes_posted;
    stats.rdma_credit_frames_sent = c.credit_frames_sent;
    stats.rdma_waits_for_credit = c.waits_for_credit;
  }
  return stats;
}

void Channel::Route(internal::ClientCall call) {
  CallStats* stats = call.ctx->mutable_stats();
  internal::ClientTransport* transport = grpc_.get();
  if (options_.policy == TransportPolicy::kGrpc) {
    stats->transport_reason = "policy 'grpc'";
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    if (rdma_state_ == RdmaState::kReady) {
      Status health = rdma_->health();
      if (health.ok()) {
        transport = rdma_.get();
      } else {
        rdma_state_ = RdmaState::kUnavailable;
        rdma_reason_ =
            absl::StrCat("RDMA connection lost (", health.message(), ")");
      }
    }
    switch (rdma_state_) {
      case RdmaState::kUnknown:
        rdma_state_ = RdmaState::kConnecting;
        if (connector_.joinable()) connector_.join();
        connector_ = std::thread([this] { ConnectRdma(); });
        [[fallthrough]];
      case RdmaState::kConnecting:
        waiting_.push_back(std::move(call));
        return;
      case RdmaState::kReady:
        break;
      case RdmaState::kUnavailable:
        if (options_.policy == TransportPolicy::kRdma) {
          stats->transport_reason = rdma_reason_;
          lock.unlock();
          auto done = std::move(call.done);
          done(absl::UnavailableError(absl::StrCat(
              "call ", call.method, " not sent: policy 'rdma' and ",
              stats->transport_reason)));
          return;
        }
        stats->transport_reason = absl::StrCat("policy 'auto': ", rdma_reason_,
                                               "; gRPC carries the call");
        break;
    }
  }
  stats->transport = transport->kind();
  transport->Start(std::move(call));
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
  Route(std::move(call));
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
