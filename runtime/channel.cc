#include "rdmarpc/channel.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/address.h"
#include "runtime/completion.h"
#include "runtime/metadata.h"
#include "runtime/random.h"
#include "runtime/spin.h"
#include "runtime/thread_pool.h"
#include "runtime/transport.h"
#include "runtime/transport_router.h"
#include "transport/grpc/grpc_client.h"
#include "transport/rdma/rdma_client.h"

namespace rdmarpc {

namespace {

// OK, or why `options` cannot make a channel.
Status CheckOptions(const ChannelOptions& options) {
  if (options.tls && options.tls->cert_chain_pem.empty() !=
                         options.tls->private_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "ChannelOptions::tls: a client certificate needs its private key "
        "(cert_chain_pem and private_key_pem, both or neither)");
  }
  return absl::OkStatus();
}

}  // namespace

Channel::Channel(std::string target, ChannelOptions options)
    : target_(std::move(target)),
      target_error_(internal::CheckTarget(target_)),
      options_(options) {
  if (target_error_.ok()) target_error_ = CheckOptions(options_);
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
  // Tearing a channel down waits for its RDMA connection to close and its
  // gRPC calls to end, which completion threads do: dropped on one (by an
  // inline handler or callback), it is torn down on the callback thread
  // instead.
  return std::shared_ptr<Channel>(
      new Channel(std::move(target), options), [](Channel* channel) {
        if (!internal::OnPollerThread()) {
          delete channel;
          return;
        }
        internal::RunOnCallbackThread([channel] { delete channel; });
      });
}

void Channel::CallAsync(std::string_view method, ClientContext* ctx,
                        const google::protobuf::Message& request,
                        google::protobuf::Message* response,
                        std::function<void(Status)> done) {
  StartCall(method, ctx, request, response, std::move(done),
            /*done_runs_inline=*/options_.run_callbacks_inline);
}

TransportKind Channel::StartCall(std::string_view method, ClientContext* ctx,
                                 const google::protobuf::Message& request,
                                 google::protobuf::Message* response,
                                 std::function<void(Status)> done,
                                 bool done_runs_inline, bool caller_drives,
                                 bool done_only_wakes) {
  if (!internal::ClientContextAccess::MarkStarted(ctx)) {
    done(absl::FailedPreconditionError(
        "ClientContext used for a second call; use one per call"));
    return TransportKind::kNone;
  }
  CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
  stats->call_id = next_call_id_.fetch_add(1);
  if (!target_error_.ok()) {
    done(target_error_);
    return TransportKind::kNone;
  }
  if (ctx->IsCancelled()) {
    done(absl::CancelledError("call cancelled before start"));
    return TransportKind::kNone;
  }
  if (!options_.interceptors.empty()) {
    Status refused;
    size_t admitted = 0;
    for (const auto& interceptor : options_.interceptors) {
      refused = interceptor->BeforeCall(method, ctx, request);
      if (!refused.ok()) break;
      ++admitted;
    }
    // The channel outlives its calls, so the interceptors do too.
    done = [interceptors = &options_.interceptors, admitted,
            method = std::string(method), ctx,
            done = std::move(done)](Status status) {
      for (size_t i = admitted; i-- > 0;) {
        (*interceptors)[i]->AfterCall(method, ctx, &status);
      }
      done(std::move(status));
    };
    if (!refused.ok()) {
      done(std::move(refused));
      return TransportKind::kNone;
    }
  }
  if (!ctx->metadata().empty()) {
    Status bad = internal::CheckMetadata(ctx->metadata(), "request metadata");
    if (!bad.ok()) {
      done(std::move(bad));
      return TransportKind::kNone;
    }
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
  call.caller_drives = caller_drives;
  call.done_only_wakes = done_only_wakes;
  return router_->Route(std::move(call));
}

namespace {

// A blocking call's meeting point with its completion. Over RDMA the caller
// spins for a while before it sleeps, so a response that comes soon is
// taken without a futex wake-up or a trip through the scheduler.
class CallWaiter {
 public:
  // On the thread that completes the call. The waiter may be gone once
  // state_ is kDone, unless the caller sleeps: it then returns only after
  // `woken_`, set here under mu_.
  void Complete(Status status) {
    status_ = std::move(status);
    if (state_.exchange(kDone, std::memory_order_acq_rel) == kSleeping) {
      std::lock_guard<std::mutex> lock(mu_);
      woken_ = true;
      cv_.notify_one();
    }
  }

  // `spin_from`: the SpinClock time the call was posted over RDMA, or 0
  // when it went over gRPC (nothing to spin for). `poll`, if set, is the
  // queue the call completes on: this thread polls it alone while it
  // spins, so the completion runs here.
  Status Wait(uint64_t spin_from, internal::CallerPoll* poll) {
    if (spin_from != 0) {
      const internal::SpinClock& clock = internal::SpinClock::Get();
      const uint64_t until = spin_from + internal::SpinTicks();
      bool taken = false;
      while (state_.load(std::memory_order_acquire) != kDone &&
             clock.Now() < until) {
        if (poll != nullptr && !taken) taken = poll->TakeForCaller();
        if (!taken || !poll->PollTaken()) internal::CpuRelax();
      }
      if (taken) {
        poll->GiveBack();
      } else if (poll != nullptr &&
                 state_.load(std::memory_order_acquire) != kDone) {
        poll->HandToEngine();
      }
    }
    // Done while spinning (the common case): Complete took no lock, and
    // neither does this.
    if (state_.load(std::memory_order_acquire) != kDone) {
      std::unique_lock<std::mutex> lock(mu_);
      int waiting = kWaiting;
      if (state_.compare_exchange_strong(waiting, kSleeping,
                                         std::memory_order_acq_rel)) {
        cv_.wait(lock, [this] { return woken_; });
      }
    }
    return std::move(status_);
  }

 private:
  static constexpr int kWaiting = 0;
  static constexpr int kSleeping = 1;
  static constexpr int kDone = 2;
  std::atomic<int> state_{kWaiting};
  Status status_;  // written before state_ becomes kDone
  std::mutex mu_;
  std::condition_variable cv_;
  bool woken_ = false;  // guarded by mu_
};

}  // namespace

Status Channel::Call(std::string_view method, ClientContext* ctx,
                     const google::protobuf::Message& request,
                     google::protobuf::Message* response) {
  if (internal::OnCompletionThread()) {
    return absl::FailedPreconditionError(
        "a blocking call on a completion thread (from a callback with "
        "ChannelOptions::run_callbacks_inline) would stall every call that "
        "thread completes, and may wait for its own thread; use CallAsync "
        "there");
  }
  // A handler run inline by the RDMA engine: the engine goes on on
  // another thread while this one waits.
  internal::BeforeBlockingCall();
  // A worker of a pool (a handler on the server's workers): the pool keeps
  // others for its queue while this one waits, since the call may need one.
  internal::ThreadPool::BlockedScope blocked;
  // On the stack, and the callback holds only its address (no heap
  // allocation): Wait returns after the last time Complete touches it.
  CallWaiter waiter;
  TransportKind took = StartCall(
      method, ctx, request, response,
      [w = &waiter](Status s) { w->Complete(std::move(s)); },
      /*done_runs_inline=*/true, /*caller_drives=*/true,
      /*done_only_wakes=*/true);
  // The spin starts about where the endpoint's round-trip sample starts
  // (the post), not before StartCall's encoding: a window measured from
  // earlier than its samples would end that much sooner than they do.
  const uint64_t posted =
      took == TransportKind::kRdma ? internal::SpinClock::Get().Now() : 0;
  std::shared_ptr<internal::CallerPoll> poll = internal::TakeCallerPoll();
  return waiter.Wait(posted, poll.get());
}

std::future<Status> Channel::CallFuture(
    std::string_view method, ClientContext* ctx,
    const google::protobuf::Message& request,
    google::protobuf::Message* response) {
  // A handler run inline by the RDMA engine that waits for the future
  // would wait for its own thread: the engine goes on on another one.
  internal::BeforeBlockingCall();
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  // Setting the promise only wakes the waiter: no hand-off to the callback
  // thread needed.
  StartCall(
      method, ctx, request, response,
      [promise](Status s) { promise->set_value(std::move(s)); },
      /*done_runs_inline=*/true, /*caller_drives=*/false,
      /*done_only_wakes=*/true);
  return future;
}

}  // namespace rdmarpc
