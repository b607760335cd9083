#include "transport/grpc/grpc_server.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/coarse_clock.h"
#include "runtime/codec.h"
#include "runtime/metadata.h"
#include "runtime/request_arena.h"
#include "runtime/tensor_walk.h"
#include "transport/grpc/health.h"
#include "transport/grpc/lean_codec.h"
#include "transport/grpc/release_mutexes.h"
#include "transport/grpc/status_convert.h"
#include "transport/grpc/tsan_tags.h"

namespace rdmarpc::grpc_transport {

using google::protobuf::Message;

// The serving side: one completion queue of the gRPC server, drained by a
// few threads; the thread that gets an event runs that step of the call, so
// a call crosses no thread of ours unless its handler runs on the worker
// pool (the way stock gRPC's synchronous server works). gRPC's callback API
// ran each step on its own executor threads: more hand-offs, and about eight
// more futex calls per call than stock's synchronous server.
class GrpcServerTransport::Service {
 public:
  // The dispatcher's methods, registered with gRPC so that a call arrives
  // with its first message, as a registered unary method's does; a call of
  // the generic service (any other path: the runtime's own methods, unknown
  // ones) reads it in a batch of its own. gRPC itself answers a call to a
  // registered method that brings no message at all: INTERNAL "Unable to
  // parse request". Paths under /grpc. stay generic: the health service and
  // reflection are answered by the generic service's calls (ServerCall).
  class Methods final : public grpc::Service {
   public:
    explicit Methods(std::vector<std::string> paths)
        : paths_(WithoutGrpcOwn(std::move(paths))) {
      // gRPC keeps the name's pointer: paths_ does not change after this.
      for (int i = 0; i < size(); ++i) {
        AddMethod(new grpc::internal::RpcServiceMethod(
            paths_[i].c_str(), grpc::internal::RpcMethod::SERVER_STREAMING,
            nullptr));
        MarkMethodAsync(i);
      }
    }
    int size() const { return static_cast<int>(paths_.size()); }
    const std::string& path(int index) const { return paths_[index]; }
    // Arms a request for method `index`: `tag` comes back on `queue` with the
    // call and its first message in `request`; `stream` is bound to it.
    void Request(int index, grpc::ServerContext* ctx, grpc::ByteBuffer* request,
                 grpc::GenericServerAsyncReaderWriter* stream,
                 grpc::ServerCompletionQueue* queue, void* tag) {
      RequestAsyncServerStreaming(index, ctx, request, stream, queue, queue,
                                  tag);
    }

   private:
    static std::vector<std::string> WithoutGrpcOwn(
        std::vector<std::string> paths) {
      std::erase_if(paths, [](const std::string& path) {
        return path.starts_with("/grpc.");
      });
      return paths;
    }

    const std::vector<std::string> paths_;
  };

  // `health` and `reflection` (null: not served) outlive the service.
  Service(internal::Dispatcher* dispatcher,
          std::map<std::string, InternalMethod> internal_methods,
          HealthStatuses* health, const ReflectionAnswerer* reflection)
      : dispatcher_(dispatcher),
        internal_methods_(std::move(internal_methods)),
        health_(health),
        reflection_(reflection),
        methods_(dispatcher->MethodPaths()) {}

  ~Service() { Stop(); }

  grpc::AsyncGenericService* generic() { return &generic_; }
  Methods* methods() { return &methods_; }
  // Before BuildAndStart.
  void AddQueue(grpc::ServerBuilder* builder) {
    queue_ = builder->AddCompletionQueue();
  }
  // After BuildAndStart: waits for calls on `threads` threads, and starts
  // the watchdog that keeps one of them free.
  void Run(int threads);
  // After Server::Shutdown returned: waits until every call is gone, then
  // drains and stops the queue. Idempotent.
  void Stop();

  internal::Dispatcher* dispatcher() { return dispatcher_; }
  const InternalMethod* FindInternal(const std::string& path) const {
    auto it = internal_methods_.find(path);
    return it == internal_methods_.end() ? nullptr : &it->second;
  }
  HealthStatuses* health() const { return health_; }
  const ReflectionAnswerer* reflection() const { return reflection_; }
  // A TCP connection as its calls see it: gRPC's peer string
  // ("ipv4:10.0.0.7:53412" names one connection) and its running calls.
  struct PeerConnection {
    explicit PeerConnection(std::string name) : peer(std::move(name)) {}
    const std::string peer;
    std::atomic<uint32_t> calls{0};
  };
  // The connection `peer`, shared by its calls: a call allocates neither.
  std::shared_ptr<PeerConnection> Connection(std::string peer);
  // A new call object waits for the next call on `queue`: of registered
  // method `method`, or of the generic service when it is kGeneric.
  static constexpr int kGeneric = -1;
  void Arm(grpc::ServerCompletionQueue* queue, int method);
  void Forget();  // a call object is gone

 private:
  // Calls the server can match at once before a thread arms more: of the
  // generic service, and of each registered method.
  static constexpr int kArmed = 8;
  static constexpr int kArmedPerMethod = 4;

  internal::Dispatcher* const dispatcher_;
  const std::map<std::string, InternalMethod> internal_methods_;
  HealthStatuses* const health_;
  const ReflectionAnswerer* const reflection_;
  grpc::AsyncGenericService generic_;
  Methods methods_;
  std::unique_ptr<grpc::ServerCompletionQueue> queue_;

  // A thread polling queue_. `events` counts the events it began and
  // ended: odd while it runs one.
  struct Poller {
    std::thread thread;
    std::atomic<uint64_t> events{0};
    std::atomic<bool> replaced{false};  // leave once the event returns
    uint64_t seen = 0;                  // events at the watchdog's last look
    bool done = false;  // it left the loop (guarded by pollers_mu_)
  };
  // A handler run inline may block (a sleep, a wait for its own cancel, a
  // call back into this server), and gRPC needs a free thread to deliver
  // whatever would release it. The watchdog looks every kIdleLook, or
  // kBusyLook after it saw a thread in an event; when every thread has
  // been in the same event since the last look, it starts one more and
  // the one it replaces leaves after its event. At most
  // kMaxReplacementThreads are replaced at a time. After a look that saw
  // no event since the one before, it sleeps until the next event begins
  // (the thread that begins it wakes it), so an idle port costs no
  // wake-ups.
  static constexpr std::chrono::milliseconds kIdleLook{100};
  static constexpr std::chrono::milliseconds kBusyLook{10};
  static constexpr int kMaxReplacementThreads = 16;
  // False when no thread could be made (the watchdog then tries again).
  bool StartPollerLocked();
  void Poll(Poller* self);
  void Watch();
  // With pollers_mu_ held: every thread's events as its last look saw them.
  bool NoEventSinceLookLocked() const;
  void WakeWatchdog();

  std::mutex pollers_mu_;
  std::condition_variable watch_cv_;
  std::list<Poller> pollers_;    // guarded by pollers_mu_
  bool watch_stopping_ = false;  // guarded by pollers_mu_
  // The watchdog waits for the next event, without a timeout. Set under
  // pollers_mu_; a thread beginning an event clears it and wakes it.
  std::atomic<bool> watchdog_asleep_{false};
  int wanted_threads_ = 0;
  std::thread watchdog_;
  bool stopped_ = false;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable gone_;
  uint64_t live_ = 0;  // call objects, armed or serving
  std::mutex connections_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<PeerConnection>>
      connections_;
  size_t connections_swept_at_ = 64;  // size that triggers the next sweep
};

std::shared_ptr<GrpcServerTransport::Service::PeerConnection>
GrpcServerTransport::Service::Connection(std::string peer) {
  std::lock_guard<std::mutex> lock(connections_mu_);
  auto found = connections_.find(peer);
  if (found != connections_.end()) return found->second;
  // Entries that no call holds (use_count 1: the map's own) belong to
  // connections with no call left; drop them now and then, so that the
  // map follows the connections that have calls. Only this function,
  // under the lock, adds holders, so a count of 1 cannot grow meanwhile.
  if (connections_.size() >= connections_swept_at_) {
    absl::erase_if(connections_, [](const auto& entry) {
      return entry.second.use_count() == 1;
    });
    connections_swept_at_ = std::max<size_t>(64, 2 * connections_.size());
  }
  auto connection = std::make_shared<PeerConnection>(peer);
  connections_.emplace(std::move(peer), connection);
  return connection;
}

namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (buffer.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return bytes;
}

bool IsReflectionPath(const std::string& path) {
  return path == "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo" ||
         path ==
             "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
}

// One call on the gRPC port, from its arrival to the end of its RPC. Reads
// the request (plain or lean), hands it to the dispatcher (or a runtime
// method), writes the response the way the request came. Every step but
// the handler runs on whichever queue thread got its event; the response
// may be started from a worker. It deletes itself once it has
// finished the RPC and every operation it started has come back.
// The standard services' streams (health Watch, reflection) run here too,
// so that the port needs no callback service and none of gRPC's
// callback-queue threads.
class ServerCall final : public HealthWatcher {
 public:
  // Waits for a call of registered method `method`, or of the generic
  // service (Service::kGeneric).
  ServerCall(GrpcServerTransport::Service* service,
             grpc::ServerCompletionQueue* queue, int method)
      : service_(service), queue_(queue), method_(method) {}

  void Request() {
    // The done tag comes back only for a call that started (gRPC issue
    // 10136), which is why a failed request is deleted at once.
    ctx_.AsyncNotifyWhenDone(Started(&done_tag_));
    if (method_ == GrpcServerTransport::Service::kGeneric) {
      service_->generic()->RequestCall(&ctx_, &stream_, queue_, queue_,
                                       Started(&request_tag_));
      return;
    }
    service_->methods()->Request(method_, &ctx_, &read_buf_, &stream_, queue_,
                                 Started(&request_tag_));
  }

  enum class Op { kRequest, kRead, kWrite, kFinish, kDone };
  struct Tag {
    ServerCall* call;
    Op op;
  };
  // A tag back from the queue: what the thread that started its operation
  // wrote before is visible here.
  static Tag* Received(void* tag) {
    TsanAcquire(tag);
    return static_cast<Tag*>(tag);
  }

  // On a queue thread: an operation came back.
  void OnEvent(Op op, bool ok) {
    switch (op) {
      case Op::kRequest:
        if (!ok) {  // the server is shutting down
          service_->Forget();
          delete this;
          return;
        }
        service_->Arm(queue_, method_);
        Begin();
        return;
      case Op::kRead:
        OnReadDone(ok);
        break;
      case Op::kWrite:
        OnWriteDone(ok);
        break;
      case Op::kFinish:
        break;
      case Op::kDone: {
        // Cancelled or past its deadline: a handler not yet started skips.
        // (It may come back while another thread is still in Begin.)
        std::lock_guard<std::mutex> lock(mu_);
        cancelled_ = ctx_.IsCancelled();
        if (cancelled_ && state_) state_->cancelled.store(true);
        // A watch ends when its client goes (or the server stops); one
        // with a write out ends when the write comes back.
        if (standard_ == Standard::kHealthWatch && !write_in_flight_) {
          FinishLocked(absl::CancelledError("health watch cancelled"));
        }
        break;
      }
    }
    bool gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone = --pending_ == 0 && finished_;
    }
    if (gone) End();
  }

 private:
  void Begin() {
    const bool generic = method_ == GrpcServerTransport::Service::kGeneric;
    const std::string& path =
        generic ? ctx_.method() : service_->methods()->path(method_);
    // The runtime's own methods and the standard services are never
    // registered.
    if (generic) {
      if (const auto* internal = service_->FindInternal(path)) {
        internal_ = internal;
        return Read();
      }
      if (path == kHealthWatchPath && service_->health() != nullptr) {
        return ReadStandard(Standard::kHealthWatch);
      }
      if (IsReflectionPath(path) && service_->reflection() != nullptr) {
        return ReadStandard(Standard::kReflection);
      }
    }
    internal::Dispatcher* dispatcher = service_->dispatcher();
    const internal::ServerMethod* method = dispatcher->Find(path);
    if (method == nullptr) {
      return FinishOnce(absl::UnimplementedError(
          absl::StrCat("method ", path, " is not served by this server")));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = std::make_shared<internal::ServerCallState>(
          method, TransportKind::kGrpc);
      if (cancelled_) state_->cancelled.store(true);
    }
    {
      std::shared_ptr<GrpcServerTransport::Service::PeerConnection> connection =
          service_->Connection(ctx_.peer());
      state_->peer =
          std::shared_ptr<const std::string>(connection, &connection->peer);
      state_->connection_calls = std::shared_ptr<std::atomic<uint32_t>>(
          connection, &connection->calls);
    }
    if (ctx_.deadline() != std::chrono::system_clock::time_point::max()) {
      state_->deadline = ctx_.deadline();
    }
    for (const auto& [k, v] : ctx_.client_metadata()) {
      std::string key(k.data(), k.size());
      std::string value(v.data(), v.size());
      if (key == kFramingKey) {
        return FinishOnce(absl::InvalidArgumentError(absl::StrCat(
            "unsupported rdmarpc framing '", value,
            "' (this server speaks lean-", kLeanVersion,
            ", told by the first message's first byte, without metadata)")));
      } else if (key == kResendKey) {
        if (!ParseResend(value)) {
          return FinishOnce(absl::InvalidArgumentError(
              absl::StrCat("malformed ", kResendKey, " '", value,
                           "' (want client.instance.age_ms)")));
        }
      } else {
        state_->client_metadata.emplace(std::move(key), std::move(value));
      }
    }
    request_ =
        internal::RequestArena::New(*method->descriptor.request_prototype);
    // A registered method's call came with its first message.
    if (!generic) return OnReadDone(true);
    Read();
  }

  // The standard services a call of the generic service may be for.
  enum class Standard { kNone, kHealthWatch, kReflection };
  // Set under mu_: the done tag may come back while Begin runs.
  void ReadStandard(Standard standard) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      standard_ = standard;
    }
    Read();
  }

  void Read() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++pending_;
    }
    stream_.Read(&read_buf_, Started(&read_tag_));
  }

  void OnReadDone(bool ok) {
    if (internal_ != nullptr) return RunInternal(ok);
    if (standard_ == Standard::kHealthWatch) return StartWatch(ok);
    if (standard_ == Standard::kReflection) return AnswerReflection(ok);
    // The first message tells the framing.
    if (ok && !receiver_ && StartsLeanStream(&read_buf_)) {
      receiver_.emplace([this](const LeanHead& head) { return OnHead(head); });
    }
    if (receiver_) {
      if (ok) {
        Status s = receiver_->OnMessage(&read_buf_);
        if (!s.ok()) return FinishOnce(s);
        // A complete request runs now: waiting for the client's end of
        // stream would cost one more read on every call. Whatever the
        // client might send past what its head announced is not read.
        if (receiver_->complete()) return Dispatch();
        return Read();
      }
      Status s = receiver_->OnEnd();
      if (!s.ok()) return FinishOnce(s);
      return Dispatch();
    }
    if (!ok) {
      return FinishOnce(
          absl::InvalidArgumentError("client sent no request message"));
    }
    Status s = AcceptPlainRequest(
        &read_buf_, request_.get(), state_->method().placement,
        service_->dispatcher()->max_request_tensor_bytes(), request_,
        &state_->tensors);
    if (!s.ok()) return FinishOnce(s);
    Dispatch();
  }

  // A runtime method: one request message in, one response message out.
  void RunInternal(bool ok) {
    if (!ok)
      return FinishOnce(absl::InvalidArgumentError("no request message"));
    StatusOr<std::string> response =
        (*internal_)(ctx_.peer(), Flatten(read_buf_));
    if (!response.ok()) return FinishOnce(response.status());
    grpc::Slice slice(*response);
    grpc::ByteBuffer(&slice, 1).Swap(&write_buf_);
    WriteAndFinishOnce();
  }

  // grpc.health.v1.Health/Watch: the service's status now, then each change,
  // until the client goes or the server stops.
  void StartWatch(bool ok) {
    if (!ok) {
      return FinishOnce(absl::InvalidArgumentError("no request message"));
    }
    StatusOr<std::string> watched = ParseHealthRequest(Flatten(read_buf_));
    if (!watched.ok()) return FinishOnce(watched.status());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;  // cancelled meanwhile
      watched_ = *std::move(watched);
      watching_ = true;
    }
    // Off mu_: OnHealth runs under the statuses' lock and takes mu_.
    service_->health()->Watch(watched_, this);
  }

  void OnHealth(ServingStatus status, bool final) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    latest_health_ = status;
    health_final_ = health_final_ || final;
    if (!write_in_flight_) WriteHealthLocked();
  }

  // Writes the watched status unless the client heard it last; once the
  // final one is out, the stream ends.
  void WriteHealthLocked() {
    if (latest_health_ != sent_health_) {
      sent_health_ = latest_health_;
      grpc::Slice slice(EncodeHealthResponse(latest_health_));
      grpc::ByteBuffer(&slice, 1).Swap(&write_buf_);
      write_in_flight_ = true;
      ++pending_;
      stream_.Write(write_buf_, Started(&write_tag_));
      return;
    }
    if (health_final_) {
      FinishLocked(absl::UnavailableError("the server is shutting down"));
    }
  }

  // grpc.reflection: each request read is answered, until the client
  // half-closes.
  void AnswerReflection(bool ok) {
    if (!ok) return FinishOnce(absl::OkStatus());
    StatusOr<std::string> answer =
        service_->reflection()->Answer(Flatten(read_buf_), &files_sent_);
    if (!answer.ok()) return FinishOnce(answer.status());
    grpc::Slice slice(*std::move(answer));
    grpc::ByteBuffer(&slice, 1).Swap(&write_buf_);
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
    stream_.Write(write_buf_, Started(&write_tag_));
  }

  void OnWriteDone(bool ok) {
    if (standard_ == Standard::kHealthWatch) {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      if (!ok || cancelled_) {
        return FinishLocked(absl::CancelledError("health watch cancelled"));
      }
      return WriteHealthLocked();
    }
    if (!ok) return FinishOnce(absl::CancelledError("response write failed"));
    if (standard_ == Standard::kReflection) return Read();
    WriteNext();
  }

  bool ParseResend(const std::string& value) {
    std::optional<ResendMetadata> r = ParseResendMetadata(value);
    if (!r) return false;
    state_->client_id = r->client_id;
    state_->resend = internal::ServerCallState::Resend{
        r->server_instance, std::chrono::milliseconds(r->age_ms),
        internal::CoarseSteadyNow()};
    return true;
  }

  StatusOr<std::vector<TensorBuffer>> OnHead(const LeanHead& head) {
    state_->call_id = head.call_id();
    RDMARPC_ASSIGN_OR_RETURN(
        internal::IncomingResult r,
        AcceptHead(head, request_.get(), state_->method().placement,
                   service_->dispatcher()->max_request_tensor_bytes(), request_,
                   &state_->tensors));
    return std::move(r.landing);
  }

  void Dispatch() {
    service_->dispatcher()->Execute(
        state_, request_, [this](Status s, std::shared_ptr<Message> response) {
          Respond(std::move(s), std::move(response));
        });
  }

  // On the queue's thread (inline handlers) or a worker.
  void Respond(Status s, std::shared_ptr<Message> response) {
    // Nothing went out yet: the handler's initial metadata still can.
    for (const auto& [k, v] : state_->initial_metadata) {
      ctx_.AddInitialMetadata(k, v);
    }
    for (const auto& [k, v] : state_->trailing_metadata) {
      ctx_.AddTrailingMetadata(k, v);
    }
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
    if (!receiver_) return RespondPlain();
    auto plan = internal::PlanOutgoing(*response_, state_->tensors);
    if (!plan.ok()) return FinishOnce(HandlerError(plan.status()));
    Status produced = internal::WaitForGpuProducer(*plan, state_->cuda_stream);
    if (!produced.ok()) return FinishOnce(HandlerError(produced));
    auto sender =
        LeanSender::Create(*response_, *plan, 0, size_t{1} << 20, nullptr);
    if (!sender.ok()) return FinishOnce(HandlerError(sender.status()));
    sender_ = std::move(*sender);
    WriteNext();
  }

  void RespondPlain() {
    uint64_t copied = 0;
    auto inlined = internal::InlineTensors(*response_, state_->tensors,
                                           state_->cuda_stream, &copied);
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++pending_;
    }
    stream_.Write(write_buf_, Started(&write_tag_));
  }

  // The last operation of the call: its response and status, or only its
  // status. At most once. Started under mu_, so that the queue's thread,
  // which may delete `this` once it comes back, waits for the caller (a
  // worker) to let go; nothing touches `this` after.
  void WriteAndFinishOnce() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = true;
    outcome_ = absl::OkStatus();
    ++pending_;
    stream_.WriteAndFinish(write_buf_, grpc::WriteOptions(), grpc::Status::OK,
                           Started(&finish_tag_));
  }
  void FinishOnce(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(s);
  }
  void FinishLocked(const Status& s) {
    if (finished_) return;
    finished_ = true;
    outcome_ = s;
    ++pending_;
    stream_.Finish(ToGrpc(s), Started(&finish_tag_));
  }

  static void* Started(Tag* tag) {
    TsanRelease(tag);
    return tag;
  }

  static Status HandlerError(const Status& s) {
    return absl::InternalError(
        absl::StrCat("handler built an invalid response: ", s.message()));
  }

  // Every operation is back and the RPC is over.
  void End() {
    // No OnHealth runs once Unwatch returned (and none started a write:
    // the call had finished).
    if (watching_) service_->health()->Unwatch(watched_, this);
    // A logged call (a re-send): its outcome reached the client unless the
    // RPC was cancelled or broke; then the log keeps it for another re-send.
    if (state_ && state_->logged) {
      if (!ctx_.IsCancelled()) {
        service_->dispatcher()->Delivered(*state_);
      } else {
        service_->dispatcher()->Undelivered(state_, outcome_,
                                            std::move(response_));
      }
    }
    GrpcServerTransport::Service* service = service_;
    delete this;
    service->Forget();
  }

  GrpcServerTransport::Service* const service_;
  grpc::ServerCompletionQueue* const queue_;
  const int method_;  // a registered method's index, or Service::kGeneric
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_{&ctx_};
  Tag request_tag_{this, Op::kRequest};
  Tag read_tag_{this, Op::kRead};
  Tag write_tag_{this, Op::kWrite};
  Tag finish_tag_{this, Op::kFinish};
  Tag done_tag_{this, Op::kDone};
  const GrpcServerTransport::InternalMethod* internal_ = nullptr;
  Standard standard_ = Standard::kNone;
  // A health watch: the service, whether Watch was called, the status it
  // last heard, the one the client last got, and whether a write is out
  // (guarded by mu_ once watching).
  std::string watched_;
  bool watching_ = false;
  ServingStatus latest_health_ = ServingStatus::kUnknown;
  std::optional<ServingStatus> sent_health_;
  bool health_final_ = false;
  bool write_in_flight_ = false;
  std::set<std::string> files_sent_;  // reflection: files this stream sent
  std::shared_ptr<internal::ServerCallState> state_;
  std::shared_ptr<Message> request_;
  std::shared_ptr<Message> response_;
  std::optional<LeanReceiver> receiver_;  // set: the call is lean
  std::optional<LeanSender> sender_;
  grpc::ByteBuffer read_buf_;
  grpc::ByteBuffer write_buf_;
  std::mutex mu_;
  bool cancelled_ = false;  // the done tag said so
  // Operations started and not back; from the start, the done tag (which
  // may come back before Begin ran, on another thread).
  int pending_ = 1;
  bool finished_ = false;  // the last operation was started
  Status outcome_;         // what Finish sent, once finished_
};

}  // namespace

void GrpcServerTransport::Service::Run(int threads) {
  for (int i = 0; i < kArmed; ++i) Arm(queue_.get(), kGeneric);
  for (int m = 0; m < methods_.size(); ++m) {
    for (int i = 0; i < kArmedPerMethod; ++i) Arm(queue_.get(), m);
  }
  std::lock_guard<std::mutex> lock(pollers_mu_);
  wanted_threads_ = threads;
  for (int i = 0; i < threads; ++i) {
    if (!StartPollerLocked() && pollers_.empty()) {
      throw std::system_error(EAGAIN, std::generic_category(),
                              "no thread for the gRPC port");
    }
  }
  watchdog_ = std::thread([this] { Watch(); });
  pthread_setname_np(watchdog_.native_handle(), "rdmarpc-grpc-wd");
}

bool GrpcServerTransport::Service::StartPollerLocked() {
  Poller& p = pollers_.emplace_back();
  try {
    p.thread = std::thread([this, &p] { Poll(&p); });
  } catch (const std::system_error&) {
    pollers_.pop_back();
    return false;
  }
  pthread_setname_np(p.thread.native_handle(), "rdmarpc-grpc");
  return true;
}

void GrpcServerTransport::Service::Poll(Poller* self) {
  void* tag = nullptr;
  bool ok = false;
  // Only this thread writes `events`.
  uint64_t events = 0;
  while (queue_->Next(&tag, &ok)) {
    // Sequentially consistent with the watchdog's store of
    // watchdog_asleep_ and its look after it: either this thread sees the
    // watchdog asleep, or the watchdog sees this event and stays awake.
    self->events.store(++events, std::memory_order_seq_cst);
    if (watchdog_asleep_.load(std::memory_order_seq_cst)) WakeWatchdog();
    ServerCall::Tag* t = ServerCall::Received(tag);
    t->call->OnEvent(t->op, ok);
    self->events.store(++events, std::memory_order_relaxed);
    if (self->replaced.load(std::memory_order_relaxed)) break;
  }
  std::lock_guard<std::mutex> lock(pollers_mu_);
  self->done = true;
}

void GrpcServerTransport::Service::WakeWatchdog() {
  if (!watchdog_asleep_.exchange(false)) return;  // another thread did
  // The watchdog may be between its last check and its wait: it holds the
  // mutex there, so the notify comes once it waits.
  { std::lock_guard<std::mutex> lock(pollers_mu_); }
  watch_cv_.notify_one();
}

bool GrpcServerTransport::Service::NoEventSinceLookLocked() const {
  for (const Poller& p : pollers_) {
    if (p.replaced.load(std::memory_order_relaxed)) continue;
    if (p.events.load(std::memory_order_seq_cst) != p.seen) return false;
  }
  return true;
}

void GrpcServerTransport::Service::Watch() {
  std::unique_lock<std::mutex> lock(pollers_mu_);
  bool busy = false;
  bool quiet = false;  // the last look saw no event since the one before
  while (true) {
    if (quiet) {
      watchdog_asleep_.store(true, std::memory_order_seq_cst);
      // An event that began after the look did not see the flag: look
      // again rather than sleep through it.
      if (NoEventSinceLookLocked()) {
        watch_cv_.wait(lock, [this] {
          return watch_stopping_ || !watchdog_asleep_.load();
        });
      }
      watchdog_asleep_.store(false);
      if (watch_stopping_) break;
    } else if (watch_cv_.wait_for(lock, busy ? kBusyLook : kIdleLook,
                                  [this] { return watch_stopping_; })) {
      break;
    }
    // Threads that left are joined here, off the calls' path.
    for (auto it = pollers_.begin(); it != pollers_.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      it->thread.join();
      it = pollers_.erase(it);
    }
    busy = false;
    quiet = true;
    bool free = false;
    Poller* stuck = nullptr;
    for (Poller& p : pollers_) {
      if (p.replaced.load(std::memory_order_relaxed)) continue;
      const uint64_t events = p.events.load(std::memory_order_relaxed);
      const bool in_event = events % 2 == 1;
      busy = busy || in_event;
      quiet = quiet && !in_event && events == p.seen;
      if (in_event && events == p.seen) {
        stuck = &p;
      } else {
        free = true;
      }
      p.seen = events;
    }
    if (free || stuck == nullptr ||
        pollers_.size() >=
            static_cast<size_t>(wanted_threads_ + kMaxReplacementThreads)) {
      continue;
    }
    // (Its event may have ended since the look: then it leaves after its
    // next one, and until then two threads wait.)
    if (StartPollerLocked()) {
      stuck->replaced.store(true, std::memory_order_relaxed);
    }
  }
}

void GrpcServerTransport::Service::Arm(grpc::ServerCompletionQueue* queue,
                                       int method) {
  if (stopping_.load()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++live_;
  }
  (new ServerCall(this, queue, method))->Request();
}

void GrpcServerTransport::Service::Forget() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--live_ == 0) gone_.notify_all();
}

void GrpcServerTransport::Service::Stop() {
  if (stopped_ || queue_ == nullptr) return;
  stopped_ = true;
  stopping_.store(true);
  {
    std::unique_lock<std::mutex> lock(mu_);
    gone_.wait(lock, [this] { return live_ == 0; });
  }
  // Every call is gone, so no event can hold a thread: the watchdog goes.
  if (watchdog_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(pollers_mu_);
      watch_stopping_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
  }
  queue_->Shutdown();
  for (Poller& p : pollers_) p.thread.join();
  // gRPC requires a queue drained before it is destroyed (no thread ran
  // when the server failed to start).
  void* tag = nullptr;
  bool ok = false;
  while (queue_->Next(&tag, &ok)) {
  }
}

namespace {

// Why a host:port cannot be bound, found by binding it ourselves the way
// gRPC does (gRPC only logs it): "Address already in use", or empty when
// the probe binds (the port came free) or the address is not host:port.
std::string WhyCannotBind(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  std::string host = address.substr(0, colon);
  std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found)) {
    return gai_strerror(rc);
  }
  std::string why;
  for (addrinfo* a = found; a != nullptr && why.empty(); a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) why = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

StatusOr<std::unique_ptr<GrpcServerTransport>> GrpcServerTransport::Start(
    const std::vector<std::pair<std::string, int*>>& ports,
    const ListenOptions& listen, internal::Dispatcher* dispatcher,
    std::map<std::string, InternalMethod> internal_methods) {
  UseReleaseModeMutexes();
  std::unique_ptr<GrpcServerTransport> t(new GrpcServerTransport());
  if (listen.health) {
    t->health_ = std::make_unique<HealthStatuses>(listen.services);
    internal_methods[kHealthCheckPath] = [health = t->health_.get()](
                                             const std::string&,
                                             const std::string& request) {
      return health->Check(request);
    };
  }
  if (listen.reflection) {
    std::vector<std::string> listed = listen.services;
    if (listen.health) listed.push_back("grpc.health.v1.Health");
    listed.push_back("grpc.reflection.v1.ServerReflection");
    listed.push_back("grpc.reflection.v1alpha.ServerReflection");
    t->reflection_ = std::make_unique<ReflectionAnswerer>(std::move(listed));
  }
  t->service_ =
      std::make_unique<Service>(dispatcher, std::move(internal_methods),
                                t->health_.get(), t->reflection_.get());
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::InsecureServerCredentials();
  if (listen.tls) {
    const TlsServerCredentials& tls = *listen.tls;
    if (tls.cert_chain_pem.empty() || tls.private_key_pem.empty()) {
      return absl::InvalidArgumentError(
          "ServerBuilder::UseTls: cert_chain_pem and private_key_pem are both "
          "needed (PEM text, not file names)");
    }
    if (tls.require_client_cert && tls.client_ca_pem.empty()) {
      return absl::InvalidArgumentError(
          "ServerBuilder::UseTls: require_client_cert needs client_ca_pem, "
          "the CAs whose client certificates to accept");
    }
    grpc::SslServerCredentialsOptions ssl(
        tls.require_client_cert
            ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
            : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_root_certs = tls.client_ca_pem;
    ssl.pem_key_cert_pairs.push_back({tls.private_key_pem, tls.cert_chain_pem});
    credentials = grpc::SslServerCredentials(ssl);
  }
  std::vector<int> bound(ports.size(), 0);
  for (size_t i = 0; i < ports.size(); ++i) {
    builder.AddListeningPort(ports[i].first, credentials, &bound[i]);
  }
  builder.RegisterAsyncGenericService(t->service_->generic());
  if (t->service_->methods()->size() > 0) {
    builder.RegisterService(t->service_->methods());
  }
  t->service_->AddQueue(&builder);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE,
                             internal::kGrpcMetadataLimitBytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT,
                             listen.port_reuse ? 1 : 0);
  if (listen.keepalive_permit.count() > 0) {
    builder.AddChannelArgument(
        GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
        static_cast<int>(listen.keepalive_permit.count()));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  {
    // gRPC adds its own health service to the servers built while this
    // global switch is on (it would take the health paths and start its
    // callback-queue threads); put it back for the program's own servers.
    const bool health_was = grpc::DefaultHealthCheckServiceEnabled();
    grpc::EnableDefaultHealthCheckService(false);
    t->server_ = builder.BuildAndStart();
    grpc::EnableDefaultHealthCheckService(health_was);
  }
  if (t->server_ == nullptr) {
    for (const auto& p : ports) {
      std::string why = WhyCannotBind(p.first);
      if (why.empty()) continue;
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", p.first, ": ", why,
          listen.port_reuse ? ""
                            : " (to share a port on purpose: "
                              "ServerBuilder::SetPortReuse(true))"));
    }
    std::string addresses;
    for (const auto& p : ports) absl::StrAppend(&addresses, " ", p.first);
    return absl::UnavailableError(
        absl::StrCat("cannot start the gRPC server on", addresses,
                     " (not an address of this machine?)"));
  }
  for (size_t i = 0; i < ports.size(); ++i) {
    if (bound[i] == 0) {
      t->server_->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", ports[i].first));
    }
    if (ports[i].second != nullptr) *ports[i].second = bound[i];
  }
  // One thread by default: gRPC lets one thread at a time wait on the
  // sockets, and hands that role to another waiting thread after each
  // batch of events, so each further thread adds wake-ups to every call.
  t->service_->Run(std::clamp(listen.threads, 1, kMaxThreads));
  return t;
}

Status GrpcServerTransport::SetServingStatus(const std::string& service,
                                             bool serving) {
  if (health_ == nullptr || server_ == nullptr) {
    return absl::FailedPreconditionError(
        "the server runs no health service (ServerBuilder::SetHealthService) "
        "or has shut down");
  }
  health_->Set(service, serving);
  return absl::OkStatus();
}

GrpcServerTransport::~GrpcServerTransport() {
  Shutdown(std::chrono::system_clock::now());
}

void GrpcServerTransport::Shutdown(
    std::chrono::system_clock::time_point deadline) {
  if (server_ == nullptr) return;
  // Every service NOT_SERVING; health watches end, so gRPC need not wait
  // for them until the deadline.
  if (health_) health_->Shutdown();
  server_->Shutdown(deadline);
  service_->Stop();
  server_->Wait();
  server_.reset();
}

}  // namespace rdmarpc::grpc_transport
