#include "transport/grpc/grpc_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/client_callback.h>

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

// One call: writes the lean request, reads the lean response. Deleted after
// OnDone: on that gRPC thread while the transport (and so its reference to
// the grpc::Channel) lives, else on a runtime thread. The user's callback runs
// when both the call is done and gRPC has released every slice that references
// the request's tensor memory.
class ClientCallReactor final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ClientCallReactor(internal::ClientCall call, size_t chunk_bytes,
                    std::shared_ptr<ChannelLife> life)
      : call_(std::move(call)),
        chunk_bytes_(chunk_bytes),
        life_(std::move(life)),
        receiver_(
            [this](const LeanHead& head) { return OnResponseHead(head); }) {}

  void Start(grpc::GenericStub* stub) {
    ClientContext* ctx = call_.ctx;
    auto plan = internal::PlanOutgoing(*call_.request, ctx->tensors());
    if (!plan.ok()) return FailBeforeStart(plan.status());
    std::string message;
    if (!call_.request->SerializeToString(&message)) {
      return FailBeforeStart(absl::InvalidArgumentError(
          "request message cannot be serialized (over protobuf's 2 GiB "
          "limit without its tensors?)"));
    }
    CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
    stats->tensor_bytes_sent = plan->total_bytes;
    for (const auto& t : plan->tensors) {
      if (!t.out_of_band) stats->cpu_copied_bytes += t.size;  // serialized
    }
    completion_ = std::make_shared<internal::DeferredCompletion>();
    sender_.emplace(MakeHead(std::move(message), *plan, call_.call_id), *plan,
                    chunk_bytes_, completion_);

    gctx_.AddMetadata(kFramingKey, kFramingLean);
    gctx_.AddMetadata(kCallIdKey, absl::StrCat(call_.call_id));
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
      return FailBeforeStart(
          absl::CancelledError("call cancelled before start"));
    }

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
    if (!ok) return;  // stream ended; OnDone follows
    Status s = receiver_.OnMessage(read_buf_);
    if (!s.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        local_error_ = s;
      }
      gctx_.TryCancel();
      return;
    }
    // Once the response is complete only the status is left, and OnDone
    // brings it: one read (and its callback) fewer per call.
    if (!receiver_.complete()) StartRead(&read_buf_);
  }

  void OnDone(const grpc::Status& grpc_status) override {
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
    // The callback waits for gRPC to drop the request's slices (they may
    // reference borrowed memory); they go at the latest with gctx_ below.
    completion_->Arm(std::move(call_.done), std::move(status));
    completion_.reset();
    sender_.reset();
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
  void FailBeforeStart(Status s) {
    auto done = std::move(call_.done);
    delete this;
    done(std::move(s));
  }

  void WriteNext() {
    bool last = false;
    auto more = sender_->Next(&write_buf_, &last);
    if (!more.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        local_error_ = more.status();
      }
      gctx_.TryCancel();
      return;
    }
    if (!*more) return;
    if (last) {
      StartWriteLast(&write_buf_, grpc::WriteOptions());
    } else {
      StartWrite(&write_buf_);
    }
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
  std::shared_ptr<ChannelLife> life_;
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
  (new ClientCallReactor(std::move(call), chunk_bytes_, life_))->Start(&stub_);
}

}  // namespace rdmarpc::grpc_transport
