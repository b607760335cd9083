#include "transport/grpc/grpc_client.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/impl/call.h>
#include <grpcpp/impl/call_op_set.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/time.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/codec.h"
#include "runtime/completion.h"
#include "runtime/metadata.h"
#include "transport/grpc/lean_codec.h"
#include "transport/grpc/release_mutexes.h"
#include "transport/grpc/status_convert.h"
#include "transport/grpc/tsan_tags.h"

namespace rdmarpc::grpc_transport {
// A message handed to a send operation by moving its ByteBuffer in. gRPC's
// own traits for a ByteBuffer duplicate it (one allocation per message).
struct MovedByteBuffer {
  grpc::ByteBuffer* buffer;
};
}  // namespace rdmarpc::grpc_transport

template <>
class grpc::SerializationTraits<rdmarpc::grpc_transport::MovedByteBuffer,
                                void> {
 public:
  static grpc::Status Serialize(
      const rdmarpc::grpc_transport::MovedByteBuffer& message,
      grpc::ByteBuffer* out, bool* own_buffer) {
    out->Swap(message.buffer);
    *own_buffer = true;
    return grpc::Status::OK;
  }
  static grpc::Status Deserialize(grpc::ByteBuffer*,
                                  rdmarpc::grpc_transport::MovedByteBuffer*) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "a send-only type");
  }
};

namespace rdmarpc::grpc_transport {
namespace {

// Lets ClientContext::TryCancel reach the gRPC call while it runs, and
// nothing after. A cancel that comes before the call exists is kept and
// applied when it starts.
class GrpcCanceller final : public internal::CallCanceller {
 public:
  void Cancel(uint64_t /*call_id: one canceller per call*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    if (call_ != nullptr) grpc_call_cancel(call_, nullptr);
  }
  void Attach(grpc_call* call) {
    std::lock_guard<std::mutex> lock(mu_);
    call_ = call;
    if (cancelled_) grpc_call_cancel(call_, nullptr);
  }
  void Detach() {
    std::lock_guard<std::mutex> lock(mu_);
    call_ = nullptr;
  }

 private:
  std::mutex mu_;
  grpc_call* call_ = nullptr;  // guarded by mu_
  bool cancelled_ = false;     // guarded by mu_
};

// The entries of gRPC's metadata a handler may have sent: the runtime's
// own ("grpc-...", "rdmarpc-...") stay out.
std::multimap<std::string, std::string> UserMetadata(
    const std::multimap<grpc::string_ref, grpc::string_ref>& received) {
  std::multimap<std::string, std::string> out;
  for (const auto& [k, v] : received) {
    std::string_view key(k.data(), k.size());
    if (key.starts_with("grpc-") || key.starts_with("rdmarpc-")) continue;
    out.emplace(std::string(key), std::string(v.data(), v.size()));
  }
  return out;
}

}  // namespace

// Where lean calls start: the core channel under the grpc::Channel, the
// grpc::Channel as the hook that runs grpcpp operation sets on a call, and
// each method path registered with the channel once (as generated stubs
// register theirs), so that a call does not copy its path.
class LeanTarget {
 public:
  LeanTarget(grpc::Channel* channel, grpc_channel* core, std::string host)
      : channel_(channel), core_(core), host_(std::move(host)) {}

  grpc::internal::CallHook* hook() const { return channel_; }

  // A new call to `method` with one reference, for the caller to drop.
  grpc_call* CreateCall(const std::string& method, grpc_completion_queue* cq,
                        gpr_timespec deadline) const {
    const char* host = host_.empty() ? nullptr : host_.c_str();
    void* registered = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = registered_.find(method);
      if (it != registered_.end()) {
        registered = it->second;
      } else if (registered_.size() < kMaxRegisteredMethods) {
        registered =
            grpc_channel_register_call(core_, method.c_str(), host, nullptr);
        registered_.emplace(method, registered);
      }
    }
    if (registered != nullptr) {
      return grpc_channel_create_registered_call(core_, nullptr,
                                                 GRPC_PROPAGATE_DEFAULTS, cq,
                                                 registered, deadline, nullptr);
    }
    grpc_slice path =
        grpc_slice_from_copied_buffer(method.data(), method.size());
    grpc_slice host_slice =
        grpc_slice_from_copied_buffer(host_.data(), host_.size());
    grpc_call* call = grpc_channel_create_call(
        core_, nullptr, GRPC_PROPAGATE_DEFAULTS, cq, path,
        host == nullptr ? nullptr : &host_slice, deadline, nullptr);
    grpc_slice_unref(path);
    grpc_slice_unref(host_slice);
    return call;
  }

 private:
  // A registration lives as long as the channel: past this many distinct
  // paths (a client that makes up method names) calls copy their path.
  static constexpr size_t kMaxRegisteredMethods = 256;

  grpc::Channel* channel_;
  grpc_channel* core_;
  std::string host_;
  mutable std::mutex mu_;
  mutable std::map<std::string, void*, std::less<>> registered_;  // mu_
};

namespace {

// What one lean call holds, whichever thread drives it: the request as a
// head and chunks, the response's receiver, and the outcome. The caller of
// `done` waits for gRPC to release every slice that references the request's
// tensor memory (see DeferredCompletion).
//
// The call is a core gRPC call driven with grpcpp's operation sets, so that
// a request of one message goes out in the same batch that reads the
// response: two batches per small call (that one and the status) where a
// stream's API takes three. (A blocking unary call takes one, but its
// status would wait for a response of several messages to be read.)
class LeanCall {
 public:
  // An operation's tag is the call's address with the operation in its
  // low bits, which alignment leaves free.
  enum Op : uintptr_t { kFirst = 1, kWrite = 2, kRead = 3, kFinish = 4 };
  static constexpr uintptr_t kOpMask = 7;
  static_assert(alignof(grpc::ClientContext) > kOpMask);

  LeanCall(internal::ClientCall call, size_t chunk_bytes)
      : call_(std::move(call)),
        chunk_bytes_(chunk_bytes),
        receiver_(
            [this](const LeanHead& head) { return OnResponseHead(head); }) {}

  ~LeanCall() {
    if (grpc_call_ != nullptr) grpc_call_unref(grpc_call_);
  }

  // Plans and serializes the request and gathers what the call starts
  // with. On an error the call must end with FailBeforeStart.
  Status Prepare() {
    ClientContext* ctx = call_.ctx;
    RDMARPC_ASSIGN_OR_RETURN(
        internal::OutgoingPlan plan,
        internal::PlanOutgoing(*call_.request, ctx->tensors()));
    // The request's device tensors are copied out on this thread, below.
    RDMARPC_RETURN_IF_ERROR(
        internal::WaitForGpuProducer(plan, ctx->cuda_stream()));
    CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
    stats->tensor_bytes_sent = plan.total_bytes;
    for (const auto& t : plan.tensors) {
      if (!t.out_of_band) stats->cpu_copied_bytes += t.size;  // serialized
    }
    completion_ = std::make_shared<internal::DeferredCompletion>();
    RDMARPC_ASSIGN_OR_RETURN(
        sender_, LeanSender::Create(*call_.request, plan, call_.call_id,
                                    chunk_bytes_, completion_));

    if (call_.resend) {
      auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - call_.resend->first_sent);
      send_metadata_.emplace(
          kResendKey,
          absl::StrCat(call_.resend->client_id, ".",
                       call_.resend->server_instance, ".", age.count()));
    }
    for (const auto& [k, v] : ctx->metadata()) send_metadata_.emplace(k, v);
    if (ctx->deadline()) {
      deadline_ = grpc::TimePoint<std::chrono::system_clock::time_point>(
                      *ctx->deadline())
                      .raw_time();
    }
    // As grpc::ClientContext::set_wait_for_ready sets them.
    metadata_flags_ =
        GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET |
        (ctx->wait_for_ready() ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0u);
    canceller_ = std::make_shared<GrpcCanceller>();
    if (!internal::ClientContextAccess::AttachCanceller(ctx, canceller_,
                                                        call_.call_id)) {
      return absl::CancelledError("call cancelled before start");
    }
    return absl::OkStatus();
  }

  // Starts the lean stream on `cq`: the first request message with the
  // metadata, the half-close and the response's first read when the
  // request is one message (else the read apart), and the finish, all at
  // once. The status comes after the last response message; asking for it
  // now saves a round through the queue. Once it returns, `this` belongs to
  // the thread that polls `cq`.
  void StartOn(const LeanTarget& target, grpc::CompletionQueue* cq) {
    grpc_call_ = target.CreateCall(call_.method, cq->cq(), deadline_);
    ops_call_ = grpc::internal::Call(grpc_call_, target.hook(), cq);
    canceller_->Attach(grpc_call_);
    bool last = false;
    const bool write = NextWrite(&last);
    first_reads_ = write && last;
    pending_.store(write && !last ? 3 : 2, std::memory_order_relaxed);
    finish_.ClientRecvStatus(&gctx_, &grpc_status_);
    finish_.set_output_tag(Tag(kFinish));
    ops_call_.PerformOps(&finish_);
    if (!write) return StartRead();
    if (!first_reads_) StartRead();
    first_.SendInitialMetadata(&send_metadata_, metadata_flags_);
    SetMessage(&first_, last);
    if (first_reads_) {
      first_.RecvInitialMetadata(&gctx_);
      first_.RecvMessage(&read_buf_);
      first_.AllowNoMessage();
    }
    first_.set_output_tag(Tag(kFirst));
    // Last: its completion may start the next write on another thread.
    ops_call_.PerformOps(&first_);
  }

  // Handles an operation that came back: true when it was the call's
  // last, and Conclude may run.
  bool Handle(Op op, bool ok) {
    switch (op) {
      case kFirst:
        if (first_reads_) {
          // The whole request went out with the half-close; a response
          // that is not whole yet is read on.
          if (ok && first_.got_message && OnRead()) StartReadAgain();
          break;
        }
        [[fallthrough]];
      case kWrite:
        if (bool last = false; ok && NextWrite(&last)) {
          pending_.fetch_add(1, std::memory_order_relaxed);
          SetMessage(&write_, last);
          write_.set_output_tag(Tag(kWrite));
          ops_call_.PerformOps(&write_);
        }
        break;
      case kRead:
        if (ok && OnRead()) StartReadAgain();
        break;
      case kFinish:
        break;
    }
    return pending_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  }

  // The call's outcome from gRPC's status; arms completion_ with `done`.
  // The done runs when the last reference to completion_ goes.
  void Conclude() {
    canceller_->Detach();
    internal::ClientContextAccess::DetachCanceller(call_.ctx);
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status = local_error_;
    }
    if (status.ok()) status = FromGrpc(grpc_status_);
    if (status.ok()) status = receiver_.OnEnd();
    if (!status.ok() && status.code() == StatusCode::kCancelled &&
        call_.ctx->IsCancelled()) {
      status = absl::CancelledError("call cancelled by the client");
    }
    // Every operation is back, the finish included, so gRPC has read the
    // server's metadata (none when the call failed before reaching it).
    internal::ClientContextAccess::SetServerMetadata(
        call_.ctx, UserMetadata(gctx_.GetServerInitialMetadata()),
        UserMetadata(gctx_.GetServerTrailingMetadata()));
    CallStats* stats = internal::ClientContextAccess::mutable_stats(call_.ctx);
    stats->cpu_copied_bytes += sender_->cpu_copied_bytes() +
                               receiver_.cpu_copied_bytes() + accept_copied_;
    stats->tensor_bytes_received = received_bytes_;
    completion_->Arm(std::move(call_.done), std::move(status),
                     call_.done_runs_inline);
    completion_.reset();
    sender_.reset();
  }

  // Ends a call that Prepare refused; `self` owns this.
  template <typename Self>
  static void FailBeforeStart(Self* self, Status s) {
    auto done = std::move(self->call_.done);
    const bool run_inline = self->call_.done_runs_inline;
    delete self;
    if (run_inline) {
      done(std::move(s));
      return;
    }
    internal::RunOnCallbackThread(
        [done = std::move(done), s = std::move(s)] { done(s); });
  }

 protected:
  void* Tag(Op op) {
    TsanRelease(this);
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(this) | op);
  }
  static std::pair<LeanCall*, Op> Untag(void* tag) {
    const auto bits = reinterpret_cast<uintptr_t>(tag);
    auto* call = reinterpret_cast<LeanCall*>(bits & ~kOpMask);
    TsanAcquire(call);
    return {call, static_cast<Op>(bits & kOpMask)};
  }

  void FailLocally(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      local_error_ = std::move(s);
    }
    canceller_->Cancel(call_.call_id);
  }

  // Fills write_buf_ with the next request message: false when none is left
  // or the call is being cancelled for a local error.
  bool NextWrite(bool* last) {
    auto more = sender_->Next(&write_buf_, last);
    if (!more.ok()) {
      FailLocally(more.status());
      return false;
    }
    return *more;
  }

  // Moves write_buf_ into `ops`, with the half-close when it is the last.
  template <typename Ops>
  void SetMessage(Ops* ops, bool last) {
    grpc::WriteOptions options;
    if (last) {
      options.set_buffer_hint();
      ops->ClientSendClose();
    }
    // Cannot fail (the buffer moves in), but gRPC asks for the status to
    // be read.
    if (grpc::Status added =
            ops->SendMessage(MovedByteBuffer{&write_buf_}, options);
        !added.ok()) {
      FailLocally(FromGrpc(added));
    }
  }

  // The response's first read when the request did not carry it.
  void StartRead() {
    read_.RecvInitialMetadata(&gctx_);
    read_.RecvMessage(&read_buf_);
    read_.set_output_tag(Tag(kRead));
    ops_call_.PerformOps(&read_);
  }

  void StartReadAgain() {
    pending_.fetch_add(1, std::memory_order_relaxed);
    read_.RecvMessage(&read_buf_);
    read_.set_output_tag(Tag(kRead));
    ops_call_.PerformOps(&read_);
  }

  // Takes read_buf_: whether another read is wanted.
  bool OnRead() {
    Status s = receiver_.OnMessage(&read_buf_);
    if (!s.ok()) {
      FailLocally(std::move(s));
      return false;
    }
    // Once the response is complete only the status is left, and the end
    // of the call brings it: one read fewer per call.
    return !receiver_.complete();
  }

  StatusOr<std::vector<TensorBuffer>> OnResponseHead(const LeanHead& head) {
    RDMARPC_ASSIGN_OR_RETURN(
        internal::IncomingResult r,
        AcceptHead(head, call_.response, call_.ctx->response_placement(),
                   call_.max_response_tensor_bytes, nullptr,
                   &call_.ctx->tensors(),
                   call_.ctx->response_tensor_buffers()));
    received_bytes_ = r.total_bytes;
    accept_copied_ = r.cpu_copied_bytes;
    return std::move(r.landing);
  }

  internal::ClientCall call_;
  size_t chunk_bytes_;
  // Only where the server's metadata lands: the call is grpc_call_.
  grpc::ClientContext gctx_;
  std::multimap<std::string, std::string> send_metadata_;
  uint32_t metadata_flags_ = 0;
  gpr_timespec deadline_ = gpr_inf_future(GPR_CLOCK_REALTIME);
  std::shared_ptr<GrpcCanceller> canceller_;
  std::shared_ptr<internal::DeferredCompletion> completion_;
  std::optional<LeanSender> sender_;
  LeanReceiver receiver_;
  grpc::ByteBuffer write_buf_;
  grpc::ByteBuffer read_buf_;
  grpc_call* grpc_call_ = nullptr;  // one reference, dropped with this
  grpc::internal::Call ops_call_;
  // The first batch: metadata and the first request message, with the
  // half-close and the first read when first_reads_.
  grpc::internal::CallOpSet<grpc::internal::CallOpSendInitialMetadata,
                            grpc::internal::CallOpSendMessage,
                            grpc::internal::CallOpClientSendClose,
                            grpc::internal::CallOpRecvInitialMetadata,
                            grpc::internal::CallOpRecvMessage<grpc::ByteBuffer>>
      first_;
  bool first_reads_ = false;
  grpc::internal::CallOpSet<grpc::internal::CallOpSendMessage,
                            grpc::internal::CallOpClientSendClose>
      write_;
  grpc::internal::CallOpSet<grpc::internal::CallOpRecvInitialMetadata,
                            grpc::internal::CallOpRecvMessage<grpc::ByteBuffer>>
      read_;
  grpc::internal::CallOpSet<grpc::internal::CallOpClientRecvStatus> finish_;
  grpc::Status grpc_status_;
  // Operations started and not yet back.
  std::atomic<int> pending_{0};
  std::mutex mu_;
  Status local_error_;
  uint64_t received_bytes_ = 0;
  uint64_t accept_copied_ = 0;
};

// A call that no caller waits on (CallAsync, CallFuture), driven through
// the transport's CallQueue: its thread handles every operation that comes
// back and deletes the call after the last one.
class QueuedCall final : private LeanCall {
 public:
  static void Start(internal::ClientCall call, size_t chunk_bytes,
                    const LeanTarget& target, CallQueue* queue);

  // An operation of a call on `queue` came back.
  static void OnEvent(void* tag, bool ok) {
    auto [call, op] = Untag(tag);
    auto* self = static_cast<QueuedCall*>(call);
    if (self->Handle(op, ok)) self->End();
  }

  // The transport is going away: ends the call with UNAVAILABLE.
  void Abandon() {
    FailLocally(absl::UnavailableError("the channel was destroyed"));
  }

 private:
  friend class LeanCall;
  friend class grpc_transport::CallQueue;

  QueuedCall(internal::ClientCall call, size_t chunk_bytes, CallQueue* queue)
      : LeanCall(std::move(call), chunk_bytes), queue_(queue) {}

  void End();

  CallQueue* queue_;
  // The queue's list of calls in flight, guarded by its mutex.
  QueuedCall* prev_ = nullptr;
  QueuedCall* next_ = nullptr;
};

// A call driven on the thread that waits for it (Channel::Call), through a
// completion queue of its own, as gRPC's own blocking stubs do: gRPC's
// poller runs on that thread, so the response needs no thread wake-up.
// Returns once `done` ran or was handed on (DeferredCompletion).
class CallerDrivenCall final : private LeanCall {
 public:
  using LeanCall::LeanCall;

  static void Run(internal::ClientCall call, size_t chunk_bytes,
                  const LeanTarget& target) {
    auto* self = new CallerDrivenCall(std::move(call), chunk_bytes);
    if (Status s = self->Prepare(); !s.ok()) {
      return FailBeforeStart(self, std::move(s));
    }
    self->Drive(target);
    delete self;  // drops gRPC's slices: `done` runs here, if not before
  }

 private:
  friend class LeanCall;

  void Drive(const LeanTarget& target) {
    grpc::CompletionQueue cq;
    StartOn(target, &cq);
    void* tag = nullptr;
    bool ok = false;
    bool ended = false;
    while (!ended && cq.Next(&tag, &ok)) ended = Handle(Untag(tag).second, ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    Conclude();
  }
};

}  // namespace

// The completion queue of the calls that no caller waits on, and the
// thread that polls it. Their `done` runs on that thread when it may run
// inline: the thread counts as a completion thread, so a channel dropped
// there is torn down elsewhere (CreateChannel) and does not wait for
// itself.
class CallQueue {
 public:
  CallQueue() : thread_([this] { Poll(); }) {
    pthread_setname_np(thread_.native_handle(), "rdmarpc-grpc-cq");
  }

  // Ends the calls in flight, waits until each came back, then stops.
  ~CallQueue() {
    {
      std::unique_lock<std::mutex> lock(mu_);
      closing_ = true;
      for (QueuedCall* c = calls_; c != nullptr; c = c->next_) c->Abandon();
      idle_.wait(lock, [this] { return calls_ == nullptr; });
    }
    cq_.Shutdown();
    thread_.join();
  }

  grpc::CompletionQueue* cq() { return &cq_; }

  void Add(QueuedCall* call) {
    std::lock_guard<std::mutex> lock(mu_);
    call->next_ = calls_;
    if (calls_ != nullptr) calls_->prev_ = call;
    calls_ = call;
  }

  void Remove(QueuedCall* call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (call->prev_ != nullptr) {
      call->prev_->next_ = call->next_;
    } else {
      calls_ = call->next_;
    }
    if (call->next_ != nullptr) call->next_->prev_ = call->prev_;
    if (closing_ && calls_ == nullptr) idle_.notify_all();
  }

 private:
  void Poll() {
    internal::MarkCompletionThread();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) QueuedCall::OnEvent(tag, ok);
  }

  grpc::CompletionQueue cq_;
  std::mutex mu_;
  std::condition_variable idle_;
  QueuedCall* calls_ = nullptr;  // guarded by mu_
  bool closing_ = false;         // guarded by mu_
  std::thread thread_;
};

namespace {

void QueuedCall::Start(internal::ClientCall call, size_t chunk_bytes,
                       const LeanTarget& target, CallQueue* queue) {
  auto* self = new QueuedCall(std::move(call), chunk_bytes, queue);
  if (Status s = self->Prepare(); !s.ok()) {
    return FailBeforeStart(self, std::move(s));
  }
  // Listed before it starts, so that the transport's end can cancel it.
  queue->Add(self);
  self->StartOn(target, queue->cq());
}

void QueuedCall::End() {
  Conclude();
  queue_->Remove(this);
  delete this;
}

}  // namespace

// The detector goes off before gRPC's threads take their first mutex.
GrpcClientTransport::GrpcRuntime::GrpcRuntime() {
  UseReleaseModeMutexes();
  grpc_init();
}
GrpcClientTransport::GrpcRuntime::~GrpcRuntime() { grpc_shutdown(); }

// The channel is made with gRPC's core API, which the lean calls use, and
// wrapped in a grpc::Channel for the rest.
GrpcClientTransport::GrpcClientTransport(const std::string& target,
                                         const ChannelOptions& options)
    : chunk_bytes_(options.grpc_chunk_bytes) {
  grpc::ChannelArguments args;
  // Tensors travel in chunks, but a plain message may still be large.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_MAX_METADATA_SIZE, internal::kGrpcMetadataLimitBytes);
  // gRPC is the fallback: after a server restart it must come back in
  // seconds, not after gRPC's default backoff of up to 120 s. gRPC reads
  // the "min reconnect backoff" as the least time it gives one connect
  // attempt (ChannelOptions::grpc_connect_attempt_timeout): at 100 ms a
  // slow host (a TCG VM) missed its first HTTP/2 handshake.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  if (options.grpc_connect_attempt_timeout.count() > 0) {
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                static_cast<int>(std::min<int64_t>(
                    options.grpc_connect_attempt_timeout.count(), INT_MAX)));
  }
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  if (options.keepalive_time.count() > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                static_cast<int>(options.keepalive_time.count()));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                static_cast<int>(options.keepalive_timeout.count()));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  grpc_channel_credentials* credentials = nullptr;
  std::string host;
  if (options.tls) {
    const TlsChannelCredentials& tls = *options.tls;
    grpc_ssl_pem_key_cert_pair key_and_chain = {tls.private_key_pem.c_str(),
                                                tls.cert_chain_pem.c_str()};
    credentials = grpc_ssl_credentials_create(
        tls.root_certs_pem.empty() ? nullptr : tls.root_certs_pem.c_str(),
        tls.private_key_pem.empty() ? nullptr : &key_and_chain, nullptr,
        nullptr);
    if (!tls.server_name_override.empty()) {
      args.SetSslTargetNameOverride(tls.server_name_override);
      host = tls.server_name_override;
    }
  } else {
    credentials = grpc_insecure_credentials_create();
  }
  grpc_channel_args core_args;
  args.SetChannelArgs(&core_args);
  grpc_channel* core =
      grpc_channel_create(target.c_str(), credentials, &core_args);
  grpc_channel_credentials_release(credentials);
  channel_ = grpc::CreateChannelInternal(host, core, {});
  stub_ = std::make_unique<grpc::GenericStub>(channel_);
  target_ = std::make_unique<LeanTarget>(channel_.get(), core, host);
}

// The calls first (each uses the channel), then the channel, then gRPC.
GrpcClientTransport::~GrpcClientTransport() { queue_.reset(); }

StatusOr<std::string> GrpcClientTransport::UnaryBytes(
    const std::string& method, const std::string& request,
    std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buf(&slice, 1);
  grpc::ByteBuffer response_buf;
  std::promise<grpc::Status> done;
  stub_->UnaryCall(&ctx, method, grpc::StubOptions(), &request_buf,
                   &response_buf,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status status = done.get_future().get();
  if (!status.ok()) return FromGrpc(status);
  std::vector<grpc::Slice> slices;
  if (!response_buf.Dump(&slices).ok()) {
    return absl::InternalError("cannot read the response bytes");
  }
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

void GrpcClientTransport::Start(internal::ClientCall call) {
  if (call.caller_drives) {
    CallerDrivenCall::Run(std::move(call), chunk_bytes_, *target_);
    return;
  }
  // Made with the first such call: an idle queue's thread would still poll
  // gRPC's sockets (one epoll set serves every queue), and take reads that
  // a caller-driven call's own thread then has to be woken for.
  std::call_once(queue_made_,
                 [this] { queue_ = std::make_unique<CallQueue>(); });
  QueuedCall::Start(std::move(call), chunk_bytes_, *target_, queue_.get());
}

}  // namespace rdmarpc::grpc_transport
