#include "rdmarpc/channel.h"

#include <pthread.h>

#include <algorithm>
#include <memory>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/transport.h"
#include "transport/grpc/grpc_client.h"
#include "transport/rdma/rdma_client.h"

namespace rdmarpc {

namespace {

uint64_t RandomNonZero() {
  std::random_device random;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{random()} << 32) | random();
  return v;
}

}  // namespace

Channel::Channel(std::string target, ChannelOptions options)
    : target_(std::move(target)),
      options_(options),
      grpc_(std::make_unique<grpc_transport::GrpcClientTransport>(target_,
                                                                  options_)),
      client_id_(RandomNonZero()) {
  if (options_.policy == TransportPolicy::kGrpc) {
    health_ = RdmaHealth::kGrpcOnly;
    rdma_reason_ = "policy 'grpc'";
  }
}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (rdma_thread_.joinable()) rdma_thread_.join();
  // Calls still on RDMA fail with UNAVAILABLE (not re-sent: the channel is
  // going); then gRPC goes.
  std::shared_ptr<rdma::RdmaClientTransport> rdma;
  std::vector<std::shared_ptr<rdma::RdmaClientTransport>> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rdma = std::move(rdma_);
    retired.swap(retired_);
  }
  rdma.reset();
  retired.clear();
}

std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options) {
  return std::shared_ptr<Channel>(new Channel(std::move(target), options));
}

rdma::RdmaConnectResult Channel::ConnectRdma() {
  rdma::RdmaClientHooks hooks;
  hooks.client_id = client_id_;
  hooks.reroute = [this](internal::ClientCall call, std::string why) {
    SendOverGrpc(std::move(call), std::move(why));
  };
  // The transport is not known yet when the hook is made; it names itself
  // through the connection it lost.
  auto self = std::make_shared<const rdma::RdmaClientTransport*>(nullptr);
  hooks.lost = [this, self](const Status& why, const std::string& trigger) {
    OnRdmaLost(*self, why, trigger);
  };
  rdma::RdmaConnectResult connected = rdma::RdmaClientTransport::Connect(
      grpc_.get(), options_, std::move(hooks));
  *self = connected.transport.get();
  return connected;
}

void Channel::OnRdmaLost(const rdma::RdmaClientTransport* transport,
                         const Status& why, const std::string& trigger) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rdma_ == nullptr || rdma_.get() != transport) return;
  MarkRdmaLostLocked(why, trigger);
}

void Channel::MarkRdmaLostLocked(const Status& why,
                                 const std::string& trigger) {
  // Not destroyed here: this may run on the engine thread, inside the
  // transport's close; the RDMA thread drops it.
  retired_.push_back(std::move(rdma_));
  health_ = RdmaHealth::kDegraded;
  ++counts_.switches;
  counts_.last_trigger = trigger;
  counts_.last_error = std::string(why.message());
  rdma_reason_ =
      absl::StrCat("RDMA connection lost: ", trigger, " (", why.message(), ")");
  cv_.notify_all();
}

void Channel::RdmaLoop() {
  std::mt19937_64 random(client_id_);
  std::chrono::milliseconds backoff = options_.rdma_probe_initial_backoff;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!retired_.empty()) {
      auto retired = std::move(retired_);
      retired_.clear();
      lock.unlock();
      retired.clear();  // waits for their calls to be re-sent
      lock.lock();
      continue;
    }
    if (stopping_ && health_ != RdmaHealth::kConnecting) return;
    if (health_ == RdmaHealth::kConnecting) {
      lock.unlock();
      rdma::RdmaConnectResult connected = ConnectRdma();
      lock.lock();
      if (connected.transport) {
        rdma_ = std::move(connected.transport);
        health_ = RdmaHealth::kReady;
      } else {
        rdma_reason_ = std::string(connected.error.message());
        // No RDMA on a side is not going to change; anything else might.
        if (connected.no_rdma) {
          health_ = RdmaHealth::kGrpcOnly;
        } else {
          health_ = RdmaHealth::kDegraded;
          counts_.last_trigger = "connect failed";
          counts_.last_error = rdma_reason_;
        }
      }
      std::vector<internal::ClientCall> waiting;
      waiting.swap(waiting_);
      lock.unlock();
      for (auto& call : waiting) Route(std::move(call));
      lock.lock();
      continue;
    }
    if (health_ != RdmaHealth::kDegraded) {
      cv_.wait(lock, [this] {
        return stopping_ || health_ == RdmaHealth::kDegraded ||
               !retired_.empty();
      });
      backoff = options_.rdma_probe_initial_backoff;
      continue;
    }
    std::uniform_real_distribution<double> jitter(0.75, 1.25);
    auto wait = std::chrono::milliseconds(
        static_cast<int64_t>(backoff.count() * jitter(random)));
    if (cv_.wait_for(lock, wait, [this] { return stopping_; })) return;
    lock.unlock();
    rdma::RdmaConnectResult connected = ConnectRdma();
    lock.lock();
    ++counts_.probes;
    if (!connected.transport) {
      counts_.last_probe_error = std::string(connected.error.message());
      backoff = std::min(backoff * 2, options_.rdma_probe_max_backoff);
      continue;
    }
    if (stopping_) {
      retired_.push_back(std::move(connected.transport));
      continue;
    }
    rdma_ = std::move(connected.transport);
    health_ = RdmaHealth::kReady;
    ++counts_.switches;
    rdma_reason_.clear();
    backoff = options_.rdma_probe_initial_backoff;
  }
}

ChannelTransportStats Channel::transport_stats() {
  ChannelTransportStats stats;
  std::shared_ptr<rdma::RdmaClientTransport> rdma;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats = counts_;
    stats.health = health_;
    rdma = rdma_;
    switch (health_) {
      case RdmaHealth::kNotTried:
        stats.rdma = "not tried yet";
        break;
      case RdmaHealth::kConnecting:
        stats.rdma = "connecting";
        break;
      case RdmaHealth::kReady:
        stats.rdma = absl::StrCat("ready: ", rdma_->description());
        break;
      case RdmaHealth::kDegraded:
      case RdmaHealth::kGrpcOnly:
        stats.rdma = rdma_reason_;
        break;
    }
  }
  stats.calls_rdma = calls_rdma_.load();
  stats.calls_grpc = calls_grpc_.load();
  stats.calls_resent = calls_resent_.load();
  if (rdma) {
    rdma::Connection::Counters c = rdma->counters();
    stats.rdma_frames_sent = c.frames_sent;
    stats.rdma_frames_received = c.frames_received;
    stats.rdma_writes_posted = c.writes_posted;
    stats.rdma_credit_frames_sent = c.credit_frames_sent;
    stats.rdma_waits_for_credit = c.waits_for_credit;
  }
  return stats;
}

void Channel::SendOverGrpc(internal::ClientCall call, std::string why) {
  CallStats* stats = call.ctx->mutable_stats();
  const bool resend = call.resend.has_value();
  if (options_.policy == TransportPolicy::kRdma) {
    stats->transport_reason = why;
    auto done = std::move(call.done);
    done(absl::UnavailableError(
        absl::StrCat("call ", call.method,
                     resend ? " failed: policy 'rdma' and "
                            : " not sent: policy 'rdma' and ",
                     why, resend ? " (it may have run on the server)" : "")));
    return;
  }
  stats->transport = TransportKind::kGrpc;
  ++calls_grpc_;
  if (options_.policy == TransportPolicy::kGrpc) {
    stats->transport_reason = why;
  } else {
    if (resend) ++calls_resent_;
    stats->transport_reason =
        absl::StrCat("policy 'auto': ", why, "; gRPC carries the call");
    // A call that fails on gRPC too says what was tried.
    call.done = [done = std::move(call.done), why,
                 resend](Status status) mutable {
      if (status.code() == StatusCode::kUnavailable) {
        status = absl::UnavailableError(absl::StrCat(
            status.message(),
            resend ? " [tried RDMA first: " : " [RDMA not used: ", why,
            "; then gRPC]"));
      }
      done(std::move(status));
    };
  }
  grpc_->Start(std::move(call));
}

void Channel::Route(internal::ClientCall call) {
  std::shared_ptr<rdma::RdmaClientTransport> rdma;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    switch (health_) {
      case RdmaHealth::kNotTried:
        health_ = RdmaHealth::kConnecting;
        rdma_thread_ = std::thread([this] { RdmaLoop(); });
        pthread_setname_np(rdma_thread_.native_handle(), "rdmarpc-probe");
        [[fallthrough]];
      case RdmaHealth::kConnecting:
        waiting_.push_back(std::move(call));
        return;
      case RdmaHealth::kReady:
        if (Status health = rdma_->health(); health.ok()) {
          rdma = rdma_;
          break;
        } else {
          // Lost before the transport could name itself to OnRdmaLost.
          MarkRdmaLostLocked(health, "connection lost");
        }
        [[fallthrough]];
      case RdmaHealth::kDegraded:
        why = absl::StrCat(rdma_reason_, "; RDMA is being probed");
        break;
      case RdmaHealth::kGrpcOnly:
        why = rdma_reason_;
        break;
    }
  }
  if (!rdma) return SendOverGrpc(std::move(call), std::move(why));
  ++calls_rdma_;
  call.ctx->mutable_stats()->transport = TransportKind::kRdma;
  rdma->Start(std::move(call));
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
  call.done_runs_inline = done_runs_inline;
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
  // Setting the promise only wakes the waiter: no hand-off to the callback
  // thread needed.
  StartCall(
      method, ctx, request, response,
      [promise](Status s) { promise->set_value(std::move(s)); },
      /*done_runs_inline=*/true);
  return future;
}

}  // namespace rdmarpc
