#include "transport/grpc/grpc_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <pthread.h>

#include <atomic>
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
namespace {

// Lets ClientContext::TryCancel reach the grpc::ClientContext while the
// call runs, and nothing after.
class GrpcCanceller final : public internal::CallCanceller {
 public:
  explicit GrpcCanceller(grpc::ClientContext* ctx) : ctx_(ctx) {}
  void Cancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx_ != nullptr) ctx_->TryCancel();
  }
  void Detach() {
    std::lock_guard<std::mutex> lock(mu_);
    ctx_ = nullptr;
  }

 private:
  std::mutex mu_;
  grpc::ClientContext* ctx_;
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

// What one lean call holds, whichever thread drives it: the request as a
// head and chunks, the response's receiver, and the outcome. The caller of
// `done` waits for gRPC to release every slice that references the request's
// tensor memory (see DeferredCompletion).
class LeanCall {
 public:
  // An operation's tag is the call's address with the operation in its
  // low bits, which alignment leaves free.
  enum Op : uintptr_t { kWrite = 1, kRead = 2, kFinish = 3 };
  static_assert(alignof(grpc::ClientContext) > kFinish);

  LeanCall(internal::ClientCall call, size_t chunk_bytes)
      : call_(std::move(call)),
        chunk_bytes_(chunk_bytes),
        receiver_(
            [this](const LeanHead& head) { return OnResponseHead(head); }) {}

  // Plans and serializes the request and sets up gctx_. On an error the
  // call must end with FailBeforeStart.
  Status Prepare() {
    ClientContext* ctx = call_.ctx;
    RDMARPC_ASSIGN_OR_RETURN(
        internal::OutgoingPlan plan,
        internal::PlanOutgoing(*call_.request, ctx->tensors()));
    // The request's device tensors are copied out on this thread, below.
    RDMARPC_RETURN_IF_ERROR(
        internal::WaitForGpuProducer(plan, ctx->cuda_stream()));
    std::string message;
    if (!call_.request->SerializeToString(&message)) {
      return absl::InvalidArgumentError(
          "request message cannot be serialized (over protobuf's 2 GiB "
          "limit without its tensors?)");
    }
    CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
    stats->tensor_bytes_sent = plan.total_bytes;
    for (const auto& t : plan.tensors) {
      if (!t.out_of_band) stats->cpu_copied_bytes += t.size;  // serialized
    }
    completion_ = std::make_shared<internal::DeferredCompletion>();
    RDMARPC_ASSIGN_OR_RETURN(
        sender_, LeanSender::Create(std::move(message), plan, call_.call_id,
                                    chunk_bytes_, completion_));

    gctx_.AddMetadata(kFramingKey, kFramingLean);
    if (call_.resend) {
      auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - call_.resend->first_sent);
      gctx_.AddMetadata(kResendKey, absl::StrCat(call_.resend->client_id, ".",
                                                 call_.resend->server_instance,
                                                 ".", age.count()));
    }
    for (const auto& [k, v] : ctx->metadata()) gctx_.AddMetadata(k, v);
    if (ctx->deadline()) gctx_.set_deadline(*ctx->deadline());
    gctx_.set_wait_for_ready(ctx->wait_for_ready());
    // The metadata goes out with the first message, in one batch.
    gctx_.set_initial_metadata_corked(true);
    canceller_ = std::make_shared<GrpcCanceller>(&gctx_);
    if (!internal::ClientContextAccess::AttachCanceller(ctx, canceller_)) {
      return absl::CancelledError("call cancelled before start");
    }
    return absl::OkStatus();
  }

  // Starts the lean stream on `cq`: the first request message (with the
  // metadata and, for a small request, the half-close), a read and the
  // finish, all at once. The status comes after the last response message;
  // asking for it now saves a round through the queue. Once it returns,
  // `this` belongs to the thread that polls `cq`.
  void StartOn(grpc::GenericStub* stub, grpc::CompletionQueue* cq) {
    stream_ = stub->PrepareCall(&gctx_, call_.method, cq);
    // Corked: the metadata goes with the first write, and no tag comes back.
    stream_->StartCall(nullptr);
    bool last = false;
    const bool write = NextWrite(&last);
    pending_.store(write ? 3 : 2, std::memory_order_relaxed);
    stream_->Read(&read_buf_, Tag(kRead));
    stream_->Finish(&grpc_status_, Tag(kFinish));
    // Last: its completion may start the next write on another thread.
    if (write) Write(last);
  }

  // Handles an operation that came back: true when it was the call's
  // last, and Conclude may run.
  bool Handle(Op op, bool ok) {
    switch (op) {
      case kWrite:
        if (bool last = false; ok && NextWrite(&last)) {
          pending_.fetch_add(1, std::memory_order_relaxed);
          Write(last);
        }
        break;
      case kRead:
        if (ok && OnRead()) {
          pending_.fetch_add(1, std::memory_order_relaxed);
          stream_->Read(&read_buf_, Tag(kRead));
        }
        break;
      case kFinish:
        break;
    }
    return pending_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  }

  // The call's outcome from gRPC's status; arms completion_ with `done`.
  // The done runs when the last reference to completion_ goes.
  void Conclude(const grpc::Status& grpc_status) {
    canceller_->Detach();
    internal::ClientContextAccess::DetachCanceller(call_.ctx);
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status = local_error_;
    }
    if (status.ok()) status = FromGrpc(grpc_status);
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
    auto* call = reinterpret_cast<LeanCall*>(bits & ~uintptr_t{3});
    TsanAcquire(call);
    return {call, static_cast<Op>(bits & 3)};
  }

  void FailLocally(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      local_error_ = std::move(s);
    }
    gctx_.TryCancel();
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

  void Write(bool last) {
    grpc::WriteOptions options;
    if (last) options.set_last_message();
    stream_->Write(write_buf_, options, Tag(kWrite));
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
  grpc::ClientContext gctx_;
  std::shared_ptr<GrpcCanceller> canceller_;
  std::shared_ptr<internal::DeferredCompletion> completion_;
  std::optional<LeanSender> sender_;
  LeanReceiver receiver_;
  grpc::ByteBuffer write_buf_;
  grpc::ByteBuffer read_buf_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
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
                    grpc::GenericStub* stub, CallQueue* queue);

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
                  grpc::GenericStub* stub) {
    auto* self = new CallerDrivenCall(std::move(call), chunk_bytes);
    if (Status s = self->Prepare(); !s.ok()) {
      return FailBeforeStart(self, std::move(s));
    }
    self->Drive(stub);
    delete self;  // drops gRPC's slices: `done` runs here, if not before
  }

 private:
  friend class LeanCall;

  void Drive(grpc::GenericStub* stub) {
    grpc::CompletionQueue cq;
    StartOn(stub, &cq);
    void* tag = nullptr;
    bool ok = false;
    bool ended = false;
    while (!ended && cq.Next(&tag, &ok)) ended = Handle(Untag(tag).second, ok);
    stream_.reset();
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    Conclude(grpc_status_);
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
                       grpc::GenericStub* stub, CallQueue* queue) {
  auto* self = new QueuedCall(std::move(call), chunk_bytes, queue);
  if (Status s = self->Prepare(); !s.ok()) {
    return FailBeforeStart(self, std::move(s));
  }
  // Listed before it starts, so that the transport's end can cancel it.
  queue->Add(self);
  self->StartOn(stub, queue->cq());
}

void QueuedCall::End() {
  stream_.reset();
  Conclude(grpc_status_);
  queue_->Remove(this);
  delete this;
}

}  // namespace

GrpcClientTransport::GrpcClientTransport(const std::string& target,
                                         const ChannelOptions& options)
    : channel_([&] {
        UseReleaseModeMutexes();
        grpc::ChannelArguments args;
        // Tensors travel in chunks, but a plain message may still be large.
        args.SetMaxReceiveMessageSize(-1);
        args.SetMaxSendMessageSize(-1);
        args.SetInt(GRPC_ARG_MAX_METADATA_SIZE,
                    internal::kGrpcMetadataLimitBytes);
        // gRPC is the fallback: after a server restart it must come back in
        // seconds, not after gRPC's default backoff of up to 120 s. gRPC
        // reads the "min reconnect backoff" as the least time it gives one
        // connect attempt: at 100 ms a slow host (a TCG VM) missed
        // its first HTTP/2 handshake. A refused connect still fails at once.
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
        if (options.keepalive_time.count() > 0) {
          args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                      static_cast<int>(options.keepalive_time.count()));
          args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                      static_cast<int>(options.keepalive_timeout.count()));
          args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
        }
        std::shared_ptr<grpc::ChannelCredentials> credentials =
            grpc::InsecureChannelCredentials();
        if (options.tls) {
          grpc::SslCredentialsOptions ssl;
          ssl.pem_root_certs = options.tls->root_certs_pem;
          ssl.pem_cert_chain = options.tls->cert_chain_pem;
          ssl.pem_private_key = options.tls->private_key_pem;
          credentials = grpc::SslCredentials(ssl);
          if (!options.tls->server_name_override.empty()) {
            args.SetSslTargetNameOverride(options.tls->server_name_override);
          }
        }
        return grpc::CreateCustomChannel(target, credentials, args);
      }()),
      stub_(channel_),
      chunk_bytes_(options.grpc_chunk_bytes),
      queue_(std::make_unique<CallQueue>()) {}

// The calls first: each holds a reference to the grpc::Channel, so that
// the last one goes here, on the thread that drops the rdmarpc::Channel.
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
  stub_.UnaryCall(&ctx, method, grpc::StubOptions(), &request_buf,
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
    CallerDrivenCall::Run(std::move(call), chunk_bytes_, &stub_);
    return;
  }
  QueuedCall::Start(std::move(call), chunk_bytes_, &stub_, queue_.get());
}

}  // namespace rdmarpc::grpc_transport
