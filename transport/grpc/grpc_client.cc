#include "transport/grpc/grpc_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/client_callback.h>

#include <cstdint>
#include <future>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/codec.h"
#include "runtime/completion.h"
#include "transport/grpc/lean_codec.h"
#include "transport/grpc/status_convert.h"

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

// What one lean call holds, whichever thread drives it: the request as a
// head and chunks, the response's receiver, and the outcome. The caller of
// `done` waits for gRPC to release every slice that references the request's
// tensor memory (see DeferredCompletion).
class LeanCall {
 public:
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
    // The metadata goes out with the first message, in one batch.
    gctx_.set_initial_metadata_corked(true);
    canceller_ = std::make_shared<GrpcCanceller>(&gctx_);
    if (!internal::ClientContextAccess::AttachCanceller(ctx, canceller_)) {
      return absl::CancelledError("call cancelled before start");
    }
    return absl::OkStatus();
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
    CallStats* stats = internal::ClientContextAccess::mutable_stats(call_.ctx);
    stats->cpu_copied_bytes += sender_->cpu_copied_bytes() +
                               receiver_.cpu_copied_bytes() + accept_copied_;
    stats->tensor_bytes_received = received_bytes_;
    completion_->Arm(std::move(call_.done), std::move(status));
    completion_.reset();
    sender_.reset();
  }

  // Ends a call that Prepare refused; `self` owns this.
  template <typename Self>
  static void FailBeforeStart(Self* self, Status s) {
    auto done = std::move(self->call_.done);
    delete self;
    done(std::move(s));
  }

 protected:
  void FailLocally(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      local_error_ = std::move(s);
    }
    gctx_.TryCancel();
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
  std::mutex mu_;
  Status local_error_;
  uint64_t received_bytes_ = 0;
  uint64_t accept_copied_ = 0;
};

// A call driven by gRPC's callback threads. Deleted after OnDone: on that
// gRPC thread while the transport (and so its reference to the
// grpc::Channel) lives, else on a runtime thread.
class ClientCallReactor final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
      private LeanCall {
 public:
  ClientCallReactor(internal::ClientCall call, size_t chunk_bytes,
                    std::shared_ptr<ChannelLife> life)
      : LeanCall(std::move(call), chunk_bytes), life_(std::move(life)) {}

  void Start(grpc::GenericStub* stub) {
    if (Status s = Prepare(); !s.ok()) return FailBeforeStart(this, s);
    stub->PrepareBidiStreamingCall(&gctx_, call_.method, grpc::StubOptions(),
                                   this);
    StartRead(&read_buf_);
    WriteNext();
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (ok && OnRead()) StartRead(&read_buf_);
  }

  void OnDone(const grpc::Status& grpc_status) override {
    Conclude(grpc_status);
    // gctx_ may hold the last reference to the grpc::Channel (the user can
    // drop the rdmarpc::Channel once the callback ran). gRPC 1.51 must not
    // release its shared callback queue from one of that queue's own
    // threads: it joins itself and frees the queue under its feet. While the
    // transport lives, its reference cannot go (its destructor waits for
    // life->mu), so the call is deleted here; else on a runtime thread. The
    // hand-off costs a thread wake-up, which small calls notice.
    std::shared_ptr<ChannelLife> life = life_;
    std::unique_lock<std::mutex> lock(life->mu);
    if (life->transport_alive) {
      delete this;
      return;
    }
    lock.unlock();
    internal::RunOnCallbackThread([this] { delete this; });
  }

 private:
  friend class LeanCall;

  void WriteNext() {
    bool last = false;
    if (!NextWrite(&last)) return;
    if (last) {
      StartWriteLast(&write_buf_, grpc::WriteOptions());
    } else {
      StartWrite(&write_buf_);
    }
  }

  std::shared_ptr<ChannelLife> life_;
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
  enum Tag : uintptr_t { kWrite = 1, kRead, kFinish };

  void Drive(grpc::GenericStub* stub) {
    grpc::CompletionQueue cq;
    auto stream = stub->PrepareCall(&gctx_, call_.method, &cq);
    // Corked: the metadata goes with the first write, and no tag comes back.
    stream->StartCall(nullptr);
    int pending = 0;
    auto write_next = [&] {
      bool last = false;
      if (!NextWrite(&last)) return;
      grpc::WriteOptions options;
      if (last) options.set_last_message();
      stream->Write(write_buf_, options, Tagged(kWrite));
      ++pending;
    };
    write_next();
    stream->Read(&read_buf_, Tagged(kRead));
    ++pending;
    grpc::Status grpc_status;
    // The status comes after the last response message; asking for it now
    // saves a round through the queue.
    stream->Finish(&grpc_status, Tagged(kFinish));
    ++pending;
    void* tag = nullptr;
    bool ok = false;
    while (pending > 0 && cq.Next(&tag, &ok)) {
      --pending;
      switch (static_cast<Tag>(reinterpret_cast<uintptr_t>(tag))) {
        case kWrite:
          if (ok) write_next();
          break;
        case kRead:
          if (ok && OnRead()) {
            stream->Read(&read_buf_, Tagged(kRead));
            ++pending;
          }
          break;
        case kFinish:
          break;
      }
    }
    stream.reset();
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    Conclude(grpc_status);
  }

  static void* Tagged(Tag t) {
    return reinterpret_cast<void*>(static_cast<uintptr_t>(t));
  }
};

}  // namespace

GrpcClientTransport::GrpcClientTransport(const std::string& target,
                                         const ChannelOptions& options)
    : channel_([&] {
        grpc::ChannelArguments args;
        // Tensors travel in chunks, but a plain message may still be large.
        args.SetMaxReceiveMessageSize(-1);
        args.SetMaxSendMessageSize(-1);
        // gRPC is the fallback: after a server restart it must come back in
        // seconds, not after gRPC's default backoff of up to 120 s. gRPC
        // reads the "min reconnect backoff" as the least time it gives one
        // connect attempt: at 100 ms a slow host (a TCG VM) missed
        // its first HTTP/2 handshake. A refused connect still fails at once.
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
        return grpc::CreateCustomChannel(
            target, grpc::InsecureChannelCredentials(), args);
      }()),
      stub_(channel_),
      chunk_bytes_(options.grpc_chunk_bytes) {}

GrpcClientTransport::~GrpcClientTransport() {
  // From here on calls finishing must not drop what may be the last
  // reference to channel_ on a gRPC thread (see ClientCallReactor::OnDone).
  std::lock_guard<std::mutex> lock(life_->mu);
  life_->transport_alive = false;
}

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
  (new ClientCallReactor(std::move(call), chunk_bytes_, life_))->Start(&stub_);
}

}  // namespace rdmarpc::grpc_transport
