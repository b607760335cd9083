#include "transport/grpc/grpc_server.h"

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <climits>
#include <mutex>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/codec.h"
#include "runtime/tensor_walk.h"
#include "transport/grpc/lean_codec.h"
#include "transport/grpc/status_convert.h"

namespace rdmarpc::grpc_transport {
namespace {

using google::protobuf::Message;

// One server call. Reads the request (plain or lean), hands it to the
// dispatcher, writes the response the way the request came. Deletes itself
// in OnDone, which gRPC runs only after Finish.
class ServerCallReactor final : public grpc::ServerGenericBidiReactor {
 public:
  ServerCallReactor(grpc::GenericCallbackServerContext* gctx,
                    internal::Dispatcher* dispatcher)
      : gctx_(gctx), dispatcher_(dispatcher) {}

  void Begin() {
    const internal::ServerMethod* method = dispatcher_->Find(gctx_->method());
    if (method == nullptr) {
      return FinishOnce(absl::UnimplementedError(absl::StrCat(
          "method ", gctx_->method(), " is not served by this server")));
    }
    state_ = std::make_shared<internal::ServerCallState>(method,
                                                         TransportKind::kGrpc);
    state_->peer = gctx_->peer();
    if (gctx_->deadline() != std::chrono::system_clock::time_point::max()) {
      state_->deadline = gctx_->deadline();
    }
    for (const auto& [k, v] : gctx_->client_metadata()) {
      std::string key(k.data(), k.size());
      std::string value(v.data(), v.size());
      if (key == kFramingKey) {
        if (value != kFramingLean) {
          return FinishOnce(absl::InvalidArgumentError(
              absl::StrCat("unsupported rdmarpc framing '", value,
                           "' (this server speaks ", kFramingLean, ")")));
        }
        lean_ = true;
      } else if (key == kResendKey) {
        if (!ParseResend(value)) {
          return FinishOnce(absl::InvalidArgumentError(
              absl::StrCat("malformed ", kResendKey, " '", value,
                           "' (want client.instance.age_ms)")));
        }
      } else if (key == kCallIdKey) {
        if (!absl::SimpleAtoi(value, &state_->call_id)) {
          return FinishOnce(absl::InvalidArgumentError(
              absl::StrCat("malformed ", kCallIdKey, " '", value, "'")));
        }
      } else {
        state_->client_metadata.emplace(std::move(key), std::move(value));
      }
    }
    request_.reset(method->descriptor.request_prototype->New());
    if (lean_) {
      receiver_.emplace([this](const LeanHead& head) { return OnHead(head); });
    }
    StartRead(&read_buf_);
  }

  void OnReadDone(bool ok) override {
    if (lean_) {
      if (ok) {
        Status s = receiver_->OnMessage(&read_buf_);
        if (!s.ok()) return FinishOnce(s);
        // A complete request runs now: waiting for the client's end of
        // stream would cost one more read and its callback on every call.
        // Whatever the client might send past what its head announced is
        // not read.
        if (receiver_->complete()) return Dispatch();
        return StartRead(&read_buf_);
      }
      Status s = receiver_->OnEnd();
      if (!s.ok()) return FinishOnce(s);
      return Dispatch();
    }
    if (!ok) {
      return FinishOnce(
          absl::InvalidArgumentError("client sent no request message"));
    }
    Status s = AcceptPlain();
    if (!s.ok()) return FinishOnce(s);
    Dispatch();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return FinishOnce(absl::CancelledError("response write failed"));
    WriteNext();
  }

  void OnCancel() override {
    if (state_) state_->cancelled.store(true);
  }

  void OnDone() override {
    // A logged call (a re-send): its outcome reached the client unless the
    // RPC was cancelled or broke; then the log keeps it for another re-send.
    if (state_ && state_->logged && finished_) {
      if (!gctx_->IsCancelled()) {
        dispatcher_->Delivered(*state_);
      } else {
        dispatcher_->Undelivered(state_, outcome_, std::move(response_));
      }
    }
    delete this;
  }

 private:
  bool ParseResend(const std::string& value) {
    std::optional<ResendMetadata> r = ParseResendMetadata(value);
    if (!r) return false;
    state_->client_id = r->client_id;
    state_->resend = internal::ServerCallState::Resend{
        r->server_instance, std::chrono::milliseconds(r->age_ms)};
    return true;
  }

  StatusOr<std::vector<TensorBuffer>> OnHead(const LeanHead& head) {
    if (head.call_id() != 0) state_->call_id = head.call_id();
    RDMARPC_ASSIGN_OR_RETURN(
        internal::IncomingResult r,
        AcceptHead(head, request_.get(), state_->method().placement,
                   dispatcher_->max_request_tensor_bytes(), request_,
                   &state_->tensors));
    return std::move(r.landing);
  }

  Status AcceptPlain() {
    return AcceptPlainRequest(
        &read_buf_, request_.get(), state_->method().placement,
        dispatcher_->max_request_tensor_bytes(), request_, &state_->tensors);
  }

  void Dispatch() {
    dispatcher_->Execute(state_, request_,
                         [this](Status s, std::unique_ptr<Message> response) {
                           Respond(std::move(s), std::move(response));
                         });
  }

  // Runs on a worker thread once the handler returned.
  void Respond(Status s, std::unique_ptr<Message> response) {
    // Past the deadline the client expects DEADLINE_EXCEEDED, whatever the
    // handler made of its cancellation.
    if (state_->deadline &&
        std::chrono::system_clock::now() > *state_->deadline) {
      return FinishOnce(absl::DeadlineExceededError(
          "deadline passed before the handler finished"));
    }
    if (!s.ok()) return FinishOnce(s);
    if (state_->cancelled.load()) {
      return FinishOnce(absl::CancelledError("call cancelled"));
    }
    response_ = std::move(response);
    if (!lean_) return RespondPlain();
    auto plan = internal::PlanOutgoing(*response_, state_->tensors);
    if (!plan.ok()) return FinishOnce(HandlerError(plan.status()));
    std::string message;
    if (!response_->SerializeToString(&message)) {
      return FinishOnce(absl::InternalError(
          "response message cannot be serialized (over protobuf's 2 GiB "
          "limit without its tensors?)"));
    }
    sender_.emplace(MakeHead(std::move(message), *plan, 0), *plan,
                    size_t{1} << 20, nullptr);
    WriteNext();
  }

  void RespondPlain() {
    uint64_t copied = 0;
    auto inlined =
        internal::InlineTensors(*response_, state_->tensors, &copied);
    if (!inlined.ok()) return FinishOnce(HandlerError(inlined.status()));
    size_t size = (*inlined)->ByteSizeLong();
    if (size > INT_MAX) {
      return FinishOnce(absl::ResourceExhaustedError(absl::StrCat(
          "response is ", size,
          " bytes with its tensors inline, over protobuf's 2 GiB limit for "
          "plain gRPC; call with an rdmarpc client, which sends tensors out "
          "of band")));
    }
    bool own = false;
    grpc::Status ser = grpc::GenericSerialize<grpc::ProtoBufferWriter, Message>(
        **inlined, &write_buf_, &own);
    if (!ser.ok()) return FinishOnce(FromGrpc(ser));
    WriteAndFinishOnce();
  }

  void WriteNext() {
    bool last = false;
    auto more = sender_->Next(&write_buf_, &last);
    if (!more.ok()) return FinishOnce(more.status());
    if (!*more) return FinishOnce(absl::OkStatus());
    if (last) return WriteAndFinishOnce();
    StartWrite(&write_buf_);
  }

  // Writes the last message and finishes, unless the call finished already.
  // The lock is released first: once the client has the response, OnDone
  // may run on another thread and delete `this` (and mu_) at once.
  void WriteAndFinishOnce() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      outcome_ = absl::OkStatus();
    }
    StartWriteAndFinish(&write_buf_, grpc::WriteOptions(), grpc::Status::OK);
  }

  static Status HandlerError(const Status& s) {
    return absl::InternalError(
        absl::StrCat("handler built an invalid response: ", s.message()));
  }

  // Finish must run exactly once; `this` may be gone right after it.
  void FinishOnce(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      outcome_ = s;
    }
    Finish(ToGrpc(s));
  }

  grpc::GenericCallbackServerContext* gctx_;
  internal::Dispatcher* dispatcher_;
  std::shared_ptr<internal::ServerCallState> state_;
  std::shared_ptr<Message> request_;
  std::unique_ptr<Message> response_;
  bool lean_ = false;
  std::optional<LeanReceiver> receiver_;
  std::optional<LeanSender> sender_;
  grpc::ByteBuffer read_buf_;
  grpc::ByteBuffer write_buf_;
  std::mutex mu_;
  bool finished_ = false;  // guarded by mu_ until OnDone
  Status outcome_;         // what Finish sent, once finished_
};

// A runtime method: one request message in, one response message out.
class InternalCallReactor final : public grpc::ServerGenericBidiReactor {
 public:
  InternalCallReactor(grpc::GenericCallbackServerContext* gctx,
                      const GrpcServerTransport::InternalMethod* method)
      : gctx_(gctx), method_(method) {
    StartRead(&read_buf_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      return Finish(ToGrpc(absl::InvalidArgumentError("no request message")));
    }
    std::vector<grpc::Slice> slices;
    std::string request;
    if (read_buf_.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        request.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    StatusOr<std::string> response = (*method_)(gctx_->peer(), request);
    if (!response.ok()) return Finish(ToGrpc(response.status()));
    grpc::Slice slice(*response);
    grpc::ByteBuffer(&slice, 1).Swap(&write_buf_);
    StartWriteAndFinish(&write_buf_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  grpc::GenericCallbackServerContext* gctx_;
  const GrpcServerTransport::InternalMethod* method_;
  grpc::ByteBuffer read_buf_;
  grpc::ByteBuffer write_buf_;
};

}  // namespace

class GrpcServerTransport::Service final : public grpc::CallbackGenericService {
 public:
  Service(internal::Dispatcher* dispatcher,
          std::map<std::string, InternalMethod> internal_methods)
      : dispatcher_(dispatcher),
        internal_methods_(std::move(internal_methods)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* gctx) override {
    if (auto it = internal_methods_.find(gctx->method());
        it != internal_methods_.end()) {
      return new InternalCallReactor(gctx, &it->second);
    }
    auto* reactor = new ServerCallReactor(gctx, dispatcher_);
    reactor->Begin();
    return reactor;
  }

 private:
  internal::Dispatcher* dispatcher_;
  std::map<std::string, InternalMethod> internal_methods_;
};

StatusOr<std::unique_ptr<GrpcServerTransport>> GrpcServerTransport::Start(
    const std::vector<std::pair<std::string, int*>>& ports,
    internal::Dispatcher* dispatcher,
    std::map<std::string, InternalMethod> internal_methods) {
  std::unique_ptr<GrpcServerTransport> t(new GrpcServerTransport());
  t->service_ =
      std::make_unique<Service>(dispatcher, std::move(internal_methods));
  grpc::ServerBuilder builder;
  std::vector<int> bound(ports.size(), 0);
  for (size_t i = 0; i < ports.size(); ++i) {
    builder.AddListeningPort(ports[i].first, grpc::InsecureServerCredentials(),
                             &bound[i]);
  }
  builder.RegisterCallbackGenericService(t->service_.get());
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  t->server_ = builder.BuildAndStart();
  std::string addresses;
  for (const auto& p : ports) absl::StrAppend(&addresses, " ", p.first);
  if (t->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot start the gRPC server on", addresses,
                     " (address in use, or not an address of this machine?)"));
  }
  for (size_t i = 0; i < ports.size(); ++i) {
    if (bound[i] == 0) {
      t->server_->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", ports[i].first));
    }
    if (ports[i].second != nullptr) *ports[i].second = bound[i];
  }
  return t;
}

GrpcServerTransport::~GrpcServerTransport() = default;

void GrpcServerTransport::Shutdown(
    std::chrono::system_clock::time_point deadline) {
  server_->Shutdown(deadline);
  server_->Wait();
}

}  // namespace rdmarpc::grpc_transport
