#include "rdmarpc/server.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "rdmarpc/diagnostics.pb.h"
#include "runtime/address.h"
#include "runtime/call_log.h"
#include "runtime/completion.h"
#include "runtime/metadata.h"
#include "runtime/random.h"
#include "runtime/spin.h"
#include "runtime/thread_pool.h"
#include "runtime/transport.h"
#include "transport/grpc/grpc_server.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/rdma_client.h"
#include "transport/rdma/rdma_server.h"

namespace rdmarpc {

const std::string& ServerContext::method() const {
  return state_->method().descriptor.path;
}
std::string ServerContext::peer() const {
  return state_->peer != nullptr ? *state_->peer : std::string();
}
TransportKind ServerContext::transport() const { return state_->transport(); }
uint64_t ServerContext::call_id() const { return state_->call_id; }
std::optional<std::chrono::system_clock::time_point> ServerContext::deadline()
    const {
  return state_->deadline;
}
bool ServerContext::IsCancelled() const {
  return state_->cancelled.load() ||
         (state_->deadline &&
          std::chrono::system_clock::now() > *state_->deadline);
}
const std::multimap<std::string, std::string>& ServerContext::client_metadata()
    const {
  return state_->client_metadata;
}
Status ServerContext::AddInitialMetadata(std::string key, std::string value) {
  return AddResponseMetadata(&state_->initial_metadata, std::move(key),
                             std::move(value));
}
Status ServerContext::AddTrailingMetadata(std::string key, std::string value) {
  return AddResponseMetadata(&state_->trailing_metadata, std::move(key),
                             std::move(value));
}
Status ServerContext::AddResponseMetadata(
    std::multimap<std::string, std::string>* to, std::string key,
    std::string value) {
  RDMARPC_RETURN_IF_ERROR(internal::CheckMetadataEntry(key, value));
  RDMARPC_RETURN_IF_ERROR(internal::CheckMetadataSize(
      state_->initial_metadata.size() + state_->trailing_metadata.size() + 1,
      internal::MetadataBytes(state_->initial_metadata) +
          internal::MetadataBytes(state_->trailing_metadata) + key.size() +
          value.size(),
      "response metadata"));
  to->emplace(std::move(key), std::move(value));
  return absl::OkStatus();
}
CallTensors& ServerContext::tensors() { return state_->tensors; }

void ServerContext::set_cuda_stream(void* stream) {
  state_->cuda_stream = stream;
}

namespace {

// rdmarpc.Diagnostics, which every server runs: `rdmarpc ping` calls it.
class DiagnosticsService final : public Service {
 public:
  explicit DiagnosticsService(const Server* server) {
    AddUnaryMethod<PingRequest, PingResponse>(
        "/rdmarpc.Diagnostics/Ping",
        [server](ServerContext* ctx, const PingRequest& request,
                 PingResponse* response) {
          response->set_payload(request.payload());
          response->set_served_over(TransportName(ctx->transport()));
          response->set_server_rdma(server->rdma_stats().status);
          return absl::OkStatus();
        });
  }
};

}  // namespace

namespace internal {
namespace {

// An inline method moves to the workers after this many stalls, if they
// are at least 1 in kStallShare of its calls.
constexpr uint64_t kStallsToMove = 8;
constexpr uint64_t kStallShare = 16;

// How long an inline handler may hold its thread before it counts as a
// stall: kCompletionThreadStall, or RDMARPC_INLINE_STALL_US (a profiler
// that slows every handler down 50 times needs more).
uint64_t StallTicks() {
  const SpinClock& clock = SpinClock::Get();
  if (const char* us = std::getenv("RDMARPC_INLINE_STALL_US")) {
    char* end = nullptr;
    unsigned long long value = std::strtoull(us, &end, 10);
    if (end != us && *end == '\0') {
      return clock.Ticks(std::chrono::microseconds(value));
    }
  }
  return clock.Ticks(kCompletionThreadStall);
}

// The dispatcher whose handler (or interceptor) this thread is running.
thread_local const Dispatcher* running_handler_of = nullptr;

bool RunningHandlerOf(const Dispatcher& dispatcher) {
  return running_handler_of == &dispatcher;
}

class HandlerScope {
 public:
  explicit HandlerScope(const Dispatcher* dispatcher)
      : was_(std::exchange(running_handler_of, dispatcher)) {}
  ~HandlerScope() { running_handler_of = was_; }

 private:
  const Dispatcher* was_;
};

}  // namespace

class ServerDispatcher final : public Dispatcher {
 public:
  // A handler queued on a poller thread until its batch is handled.
  struct DeferredHandler {
    ServerDispatcher* dispatcher;
    std::shared_ptr<ServerCallState> state;
    std::shared_ptr<google::protobuf::Message> request;
    Completion done;
  };
  // Per thread: only the thread holding a poller queues and runs them.
  static std::vector<DeferredHandler>& DeferredHandlers() {
    thread_local std::vector<DeferredHandler> queued;
    return queued;
  }
  static void RunDeferredHandlers() {
    std::vector<DeferredHandler>& queued = DeferredHandlers();
    // Handlers run by index: one may (in a test) queue another.
    for (size_t i = 0; i < queued.size(); ++i) {
      DeferredHandler h = std::move(queued[i]);
      h.dispatcher->Run(std::move(h.state), std::move(h.request),
                        std::move(h.done), true);
    }
    queued.clear();
  }

  ServerDispatcher(absl::flat_hash_map<std::string, ServerMethod> methods,
                   int workers, uint64_t max_request_tensor_bytes,
                   uint32_t max_calls_per_connection, bool run_inline,
                   std::vector<std::shared_ptr<ServerInterceptor>> interceptors,
                   std::chrono::milliseconds log_window, size_t log_max_records)
      : methods_(std::move(methods)),
        interceptors_(std::move(interceptors)),
        max_request_tensor_bytes_(max_request_tensor_bytes),
        max_calls_per_connection_(max_calls_per_connection),
        run_inline_(run_inline),
        log_(CallLog::Options{.window = log_window,
                              .max_records = log_max_records,
                              .run_repeat_answer =
                                  [this](std::function<void()> answer) {
                                    pool_.Post(std::move(answer));
                                  },
                              .sweep_sooner = [this] { SweepSooner(); }},
             RandomNonZero()),
        // Inline, the pool answers repeats from the log and runs the
        // methods marked blocking or moved there.
        pool_(workers, "rdmarpc-worker", ThreadPool::Growth::kWhileBlocked) {
    sweeper_ = std::thread([this] { SweepLog(); });
    pthread_setname_np(sweeper_.native_handle(), "rdmarpc-log");
  }

  ~ServerDispatcher() override {
    {
      std::lock_guard<std::mutex> lock(sweep_mu_);
      stop_sweeping_ = true;
    }
    sweep_cv_.notify_all();
    sweeper_.join();
  }

  // Re-sends still waiting at `deadline` get UNAVAILABLE then, so that a
  // transport's shutdown never waits on a call the log holds back.
  void CloseLogAt(std::chrono::system_clock::time_point deadline) {
    {
      std::lock_guard<std::mutex> lock(sweep_mu_);
      close_log_at_ = deadline;
      sweep_sooner_ = true;
    }
    sweep_cv_.notify_all();
  }

  const ServerMethod* Find(std::string_view path) const override {
    auto it = methods_.find(absl::string_view(path.data(), path.size()));
    return it == methods_.end() ? nullptr : &it->second;
  }

  std::vector<std::string> MethodPaths() const override {
    std::vector<std::string> paths;
    paths.reserve(methods_.size());
    for (const auto& [path, method] : methods_) paths.push_back(path);
    return paths;
  }

  uint64_t max_request_tensor_bytes() const override {
    return max_request_tensor_bytes_;
  }

  void Execute(std::shared_ptr<ServerCallState> state,
               std::shared_ptr<google::protobuf::Message> request,
               Completion done) override {
    // `done` is run as it came: wrapping it would cost a heap allocation
    // or two per call.
    if (state->client_id != 0) {
      state->logged = true;
      if (!log_.Admit(state, done)) return;  // a repeat: the log answers it
    }
    // Counted until the handler's outcome is in (not until it is sent).
    if (state->connection_calls != nullptr &&
        state->connection_calls->fetch_add(1, std::memory_order_relaxed) >=
            max_calls_per_connection_) {
      state->connection_calls->fetch_sub(1, std::memory_order_relaxed);
      over_connection_limit_.fetch_add(1, std::memory_order_relaxed);
      Status refused = absl::ResourceExhaustedError(absl::StrCat(
          "the server runs at most ", max_calls_per_connection_,
          " calls at once per connection and this connection has that many "
          "running: wait for some to finish, spread calls over more "
          "channels, or raise the limit "
          "(ServerBuilder::SetMaxCallsPerConnection)"));
      if (state->logged) log_.Finished(*state, refused, nullptr);
      return done(std::move(refused), nullptr);
    }
    const ServerMethod& method = state->method();
    PollerHooks* poller = ThreadPoller();
    // An RDMA call dispatched off the engine (by the registration thread,
    // after landing a large request) goes to the workers: that thread
    // serves every registration of the process.
    const bool on_receiver =
        run_inline_ && !method.blocking &&
        !method.inline_record.moved_to_workers.load(
            std::memory_order_relaxed) &&
        (poller != nullptr || state->transport() != TransportKind::kRdma);
    if (!on_receiver) {
      pool_.Post([this, state = std::move(state), request = std::move(request),
                  done = std::move(done)]() mutable {
        Run(std::move(state), std::move(request), std::move(done), false);
      });
      return;
    }
    if (poller != nullptr) {
      // After the batch, when the engine holds no connection's queue: a
      // handler that blocks then loses the engine, not its own cancels.
      DeferredHandlers().push_back(
          {this, std::move(state), std::move(request), std::move(done)});
      poller->RunAfterBatch(&ServerDispatcher::RunDeferredHandlers);
      return;
    }
    Run(std::move(state), std::move(request), std::move(done), true);
  }

  void Run(std::shared_ptr<ServerCallState> state,
           std::shared_ptr<google::protobuf::Message> request, Completion done,
           bool on_receiver) {
    auto finish = [&](Status s,
                      std::shared_ptr<google::protobuf::Message> response) {
      if (state->connection_calls != nullptr) {
        state->connection_calls->fetch_sub(1, std::memory_order_relaxed);
      }
      if (state->logged) log_.Finished(*state, s, response.get());
      done(std::move(s), std::move(response));
    };
    // A call whose caller gave up does not run: its deadline may pass,
    // or its cancel be lost with a broken connection, while it queues.
    if (state->deadline &&
        std::chrono::system_clock::now() >= *state->deadline) {
      not_started_past_deadline_.fetch_add(1, std::memory_order_relaxed);
      return finish(absl::DeadlineExceededError(
                        "deadline passed before the handler started"),
                    nullptr);
    }
    if (state->cancelled.load()) {
      not_started_cancelled_.fetch_add(1, std::memory_order_relaxed);
      return finish(
          absl::CancelledError("call cancelled before its handler ran"),
          nullptr);
    }
    started_.fetch_add(1, std::memory_order_relaxed);
    const ServerMethod& method = state->method();
    const MethodDescriptor& m = method.descriptor;
    // On the request's arena when it has one (internal::RequestArena): a
    // handler on the thread that made the arena (an inline one) then
    // builds it with no allocation of its own; on another thread the
    // arena's first allocation takes a block for that thread.
    std::shared_ptr<google::protobuf::Message> response;
    if (google::protobuf::Arena* arena = request->GetArena()) {
      response = {request, m.response_prototype->New(arena)};
    } else {
      response.reset(m.response_prototype->New());
    }
    ServerContext ctx(state.get());
    Status status;
    const internal::SpinClock& clock = internal::SpinClock::Get();
    const uint64_t began = on_receiver ? clock.Now() : 0;
    size_t admitted = 0;  // interceptors whose BeforeHandler said OK
    {
      const HandlerScope handler_scope(this);
      for (; admitted < interceptors_.size(); ++admitted) {
        status = interceptors_[admitted]->BeforeHandler(&ctx, *request);
        if (!status.ok()) break;
      }
      if (status.ok()) {
        std::optional<InlineHandlerScope> inline_scope;
        if (on_receiver) inline_scope.emplace();
        try {
          status = m.handler(&ctx, *request, response.get());
        } catch (const std::exception& e) {
          status = absl::InternalError(
              absl::StrCat("handler of ", m.path, " threw: ", e.what()));
        } catch (...) {
          status = absl::InternalError(
              absl::StrCat("handler of ", m.path, " threw a non-exception"));
        }
      }
      for (size_t i = admitted; i-- > 0;) {
        interceptors_[i]->AfterHandler(&ctx, &status);
      }
    }
    if (on_receiver) NoteInlineRun(method, clock.Now() - began);
    finish(std::move(status), std::move(response));
  }

  // Moves a method to the workers once a handler blocked in a call of
  // ours, or once its handlers stalled their thread kStallsToMove times
  // and in at least 1 of kStallShare calls: one stall may be the thread
  // being preempted (a loaded machine, a first call), not the handler.
  void NoteInlineRun(const ServerMethod& method, uint64_t ticks) {
    ServerMethod::InlineRecord& record = method.inline_record;
    // Lossy when two threads run the method at once; a ratio needs no more.
    const uint64_t calls = record.calls.load(std::memory_order_relaxed) + 1;
    record.calls.store(calls, std::memory_order_relaxed);
    bool move = TakeInlineHandlerBlocked();
    if (ticks >= stall_ticks_) {
      inline_stalls_.fetch_add(1, std::memory_order_relaxed);
      const uint64_t stalls =
          record.stalls.fetch_add(1, std::memory_order_relaxed) + 1;
      move = move || (stalls >= kStallsToMove && stalls * kStallShare >= calls);
    }
    if (move && !record.moved_to_workers.exchange(true)) {
      moved_to_workers_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void Delivered(const ServerCallState& state) override {
    if (state.logged) log_.Delivered(state);
  }
  void Undelivered(
      std::shared_ptr<ServerCallState> state, Status status,
      std::shared_ptr<google::protobuf::Message> response) override {
    if (state->logged) {
      log_.Undelivered(std::move(state), std::move(status),
                       std::move(response));
    }
  }
  uint64_t server_instance() const override { return log_.server_instance(); }
  CallLog::Stats call_log_stats() { return log_.stats(); }
  HandlerStats handler_stats() const {
    return {
        .started = started_.load(std::memory_order_relaxed),
        .not_started_cancelled =
            not_started_cancelled_.load(std::memory_order_relaxed),
        .not_started_past_deadline =
            not_started_past_deadline_.load(std::memory_order_relaxed),
        .inline_stalls = inline_stalls_.load(std::memory_order_relaxed),
        .moved_to_workers = moved_to_workers_.load(std::memory_order_relaxed),
        .over_connection_limit =
            over_connection_limit_.load(std::memory_order_relaxed)};
  }

 private:
  // Sweeps the log when it has work (so waiting re-sends time out and old
  // records go without new traffic), and closes it at the shutdown
  // deadline. With nothing due it sleeps until a call brings work.
  void SweepLog() {
    using SystemClock = std::chrono::system_clock;
    using LogClock = CallLog::Clock;
    // A floor on each wait: the log's coarse clock may read a due time as
    // still ahead for a few milliseconds after it passed. A ceiling too, so
    // that a far shutdown deadline makes no wait the clocks cannot add.
    constexpr std::chrono::nanoseconds kMinWait = std::chrono::milliseconds(10);
    constexpr std::chrono::hours kMaxWait{1};
    std::unique_lock<std::mutex> lock(sweep_mu_);
    bool closed = false;
    LogClock::time_point due = LogClock::time_point::max();
    auto woken = [this] { return stop_sweeping_ || sweep_sooner_; };
    while (!stop_sweeping_) {
      std::optional<std::chrono::nanoseconds> wait;
      if (due != LogClock::time_point::max()) wait = due - LogClock::now();
      if (close_log_at_ && !closed) {
        // Subtracted only when ahead, and capped in the clock's own unit:
        // no deadline overflows it.
        const SystemClock::time_point now = SystemClock::now();
        std::chrono::nanoseconds to_close{0};
        if (*close_log_at_ > now) {
          to_close = std::chrono::duration_cast<std::chrono::nanoseconds>(
              std::min<SystemClock::duration>(*close_log_at_ - now, kMaxWait));
        }
        wait = wait ? std::min(*wait, to_close) : to_close;
      }
      if (wait) {
        sweep_cv_.wait_for(
            lock,
            std::clamp<std::chrono::nanoseconds>(*wait, kMinWait, kMaxWait),
            woken);
      } else {
        sweep_cv_.wait(lock, woken);
      }
      sweep_sooner_ = false;
      if (stop_sweeping_) break;
      bool close =
          !closed && close_log_at_ && SystemClock::now() >= *close_log_at_;
      lock.unlock();
      if (close) log_.Close();
      due = log_.Sweep();
      lock.lock();
      closed = closed || close;
    }
  }

  // CallLog::Options::sweep_sooner.
  void SweepSooner() {
    {
      std::lock_guard<std::mutex> lock(sweep_mu_);
      sweep_sooner_ = true;
    }
    sweep_cv_.notify_all();
  }

  absl::flat_hash_map<std::string, ServerMethod> methods_;
  const std::vector<std::shared_ptr<ServerInterceptor>> interceptors_;
  uint64_t max_request_tensor_bytes_;
  uint32_t max_calls_per_connection_;
  bool run_inline_;
  const uint64_t stall_ticks_ = StallTicks();
  std::atomic<uint64_t> started_{0};
  std::atomic<uint64_t> not_started_cancelled_{0};
  std::atomic<uint64_t> not_started_past_deadline_{0};
  std::atomic<uint64_t> inline_stalls_{0};
  std::atomic<uint64_t> moved_to_workers_{0};
  std::atomic<uint64_t> over_connection_limit_{0};
  CallLog log_;
  ThreadPool pool_;
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  bool stop_sweeping_ = false;
  bool sweep_sooner_ = false;  // guarded by sweep_mu_
  std::optional<std::chrono::system_clock::time_point> close_log_at_;
  std::thread sweeper_;
};

}  // namespace internal

ServerBuilder::ServerBuilder() = default;
ServerBuilder::~ServerBuilder() = default;

ServerBuilder& ServerBuilder::AddListeningPort(std::string address,
                                               int* selected_port) {
  ports_.emplace_back(std::move(address), selected_port);
  return *this;
}

ServerBuilder& ServerBuilder::SetPortReuse(bool reuse) {
  port_reuse_ = reuse;
  return *this;
}

ServerBuilder& ServerBuilder::UseTls(TlsServerCredentials tls) {
  tls_ = std::move(tls);
  return *this;
}

ServerBuilder& ServerBuilder::SetHealthService(bool enable) {
  health_service_ = enable;
  return *this;
}

ServerBuilder& ServerBuilder::EnableReflection(bool enable) {
  reflection_ = enable;
  return *this;
}

ServerBuilder& ServerBuilder::SetKeepalivePermit(
    std::chrono::milliseconds min_interval) {
  keepalive_permit_ = min_interval;
  return *this;
}

ServerBuilder& ServerBuilder::AddInterceptor(
    std::shared_ptr<ServerInterceptor> interceptor) {
  interceptors_.push_back(std::move(interceptor));
  return *this;
}

ServerBuilder& ServerBuilder::RegisterService(Service* service) {
  services_.push_back(service);
  return *this;
}

ServerBuilder& ServerBuilder::SetNumWorkers(int n) {
  workers_ = n;
  return *this;
}

ServerBuilder& ServerBuilder::SetGrpcThreads(int n) {
  grpc_threads_ = n > 0 ? n : 1;
  return *this;
}

ServerBuilder& ServerBuilder::SetTensorPlacement(Device device) {
  placement_ = device;
  return *this;
}

ServerBuilder& ServerBuilder::SetMethodTensorPlacement(std::string method_path,
                                                       Device device) {
  method_placement_[std::move(method_path)] = device;
  return *this;
}

ServerBuilder& ServerBuilder::SetFieldTensorPlacement(std::string method_path,
                                                      std::string field_name,
                                                      Device device) {
  field_placement_[{std::move(method_path), std::move(field_name)}] = device;
  return *this;
}

ServerBuilder& ServerBuilder::SetGpuRdmaMode(GpuRdmaMode mode) {
  gpu_rdma_mode_ = mode;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxCallsPerConnection(uint32_t calls) {
  max_calls_per_connection_ = calls;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxRdmaConnections(uint32_t connections) {
  max_rdma_connections_ = connections;
  return *this;
}

ServerBuilder& ServerBuilder::SetCallLogWindow(
    std::chrono::milliseconds window) {
  call_log_window_ = window;
  return *this;
}

ServerBuilder& ServerBuilder::SetCallLogMaxRecords(size_t records) {
  call_log_max_records_ = records;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxRequestTensorBytes(uint64_t bytes) {
  max_request_tensor_bytes_ = bytes;
  return *this;
}

ServerBuilder& ServerBuilder::EnableRdma(bool enable) {
  rdma_ = enable;
  return *this;
}

ServerBuilder& ServerBuilder::SetRdmaReceives(uint32_t receives) {
  rdma_receives_ = receives;
  return *this;
}

ServerBuilder& ServerBuilder::SetRdmaLandingPoolBytes(uint64_t bytes) {
  rdma_landing_pool_bytes_ = bytes;
  return *this;
}

ServerBuilder& ServerBuilder::SetRunHandlersInline(bool run_inline) {
  handlers_inline_ = run_inline;
  return *this;
}

ServerBuilder& ServerBuilder::SetMethodBlocking(std::string method_path) {
  blocking_methods_.insert(std::move(method_path));
  return *this;
}

StatusOr<std::unique_ptr<Server>> ServerBuilder::BuildAndStart() {
  if (ports_.empty()) {
    return absl::InvalidArgumentError(
        "ServerBuilder: no listening port; call AddListeningPort()");
  }
  for (const auto& [address, selected] : ports_) {
    RDMARPC_RETURN_IF_ERROR(internal::CheckListenAddress(address));
  }
  if (grpc_threads_ > grpc_transport::GrpcServerTransport::kMaxThreads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerBuilder: SetGrpcThreads(", grpc_threads_, ") is over the ",
        grpc_transport::GrpcServerTransport::kMaxThreads, " allowed"));
  }
  const Device default_placement = placement_.value_or(
      CudaDeviceCount() > 0 ? Device::Cuda(0) : Device::Host());
  std::unique_ptr<Server> server(new Server());
  DiagnosticsService diagnostics(server.get());
  std::vector<Service*> services = services_;
  services.push_back(&diagnostics);
  absl::flat_hash_map<std::string, internal::ServerMethod> methods;
  for (Service* service : services) {
    if (service == nullptr) {
      return absl::InvalidArgumentError("ServerBuilder: null service");
    }
    for (const MethodDescriptor& m : service->methods()) {
      internal::TensorPlacement placement(default_placement);
      if (auto it = method_placement_.find(m.path);
          it != method_placement_.end()) {
        placement.device = it->second;
      }
      if (!methods
               .emplace(m.path, internal::ServerMethod{m, placement, false, {}})
               .second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ServerBuilder: method ", m.path, " registered twice"));
      }
    }
  }
  for (const auto& [path, device] : method_placement_) {
    if (!methods.contains(path)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ServerBuilder: placement set for unknown method ", path));
    }
  }
  for (const std::string& path : blocking_methods_) {
    auto it = methods.find(path);
    if (it == methods.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ServerBuilder: SetMethodBlocking names unknown method ",
                       path, " (a path is \"/package.Service/Method\")"));
    }
    it->second.blocking = true;
  }
  for (const auto& [key, device] : field_placement_) {
    const auto& [path, field_name] = key;
    auto it = methods.find(path);
    if (it == methods.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ServerBuilder: placement set for unknown method ", path));
    }
    const google::protobuf::Descriptor* request =
        it->second.descriptor.request_prototype->GetDescriptor();
    const google::protobuf::FieldDescriptor* field =
        request->FindFieldByName(field_name);
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("ServerBuilder: placement set for field ", field_name,
                       ", which ", request->full_name(), " does not have"));
    }
    it->second.placement.by_field[field->number()] = device;
  }
  // Placement on a GPU this process cannot use is a configuration error.
  for (const auto& [path, m] : methods) {
    for (const Device& d : m.placement.Devices()) {
      if (d.is_host()) continue;
      Status s = CudaDeviceStatus(d.index);
      if (!s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("ServerBuilder: tensors of ", path, " placed on ",
                         d.ToString(), ": ", s.message()));
      }
    }
  }
  int workers =
      workers_ > 0
          ? workers_
          : std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
  for (const auto& [path, method] : methods) {
    // "/package.Service/Method" -> "package.Service"
    server->service_names_.insert(path.substr(1, path.rfind('/') - 1));
  }
  if (Status receives = rdma::CheckReceives(
          rdma_receives_, rdma::ConnectionConfig{}.receive_bytes,
          "ServerBuilder::SetRdmaReceives");
      !receives.ok()) {
    return receives;
  }
  if (call_log_window_ < std::chrono::seconds(1) ||
      call_log_window_ > std::chrono::hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerBuilder::SetCallLogWindow: the window must be from 1 s to "
        "24 h, not ",
        call_log_window_.count(), " ms"));
  }
  if (call_log_max_records_ < 1024 ||
      call_log_max_records_ > (size_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerBuilder::SetCallLogMaxRecords: the log holds from 1024 to "
        "16777216 records, not ",
        call_log_max_records_));
  }
  server->dispatcher_ = std::make_unique<internal::ServerDispatcher>(
      std::move(methods), workers, max_request_tensor_bytes_,
      max_calls_per_connection_, handlers_inline_, interceptors_,
      call_log_window_, call_log_max_records_);
  std::unique_ptr<rdma::RdmaServerTransport> rdma;
  std::string no_rdma = "RDMA disabled in the server's configuration";
  if (rdma_) {
    rdma::RdmaServerOptions options;
    options.receives = rdma_receives_;
    options.landing_pool_bytes = rdma_landing_pool_bytes_;
    options.max_connections = max_rdma_connections_;
    options.gpu_rdma_mode = gpu_rdma_mode_;
    auto started =
        rdma::RdmaServerTransport::Start(server->dispatcher_.get(), options);
    if (started.ok()) {
      rdma = *std::move(started);
    } else {
      no_rdma = std::string(started.status().message());
    }
  }
  std::map<std::string, grpc_transport::GrpcServerTransport::InternalMethod>
      internal_methods;
  if (rdma) {
    rdma::RdmaServerTransport* raw = rdma.get();
    internal_methods[rdma::kHelloMethod] = [raw](const std::string&,
                                                 const std::string& request) {
      return raw->Hello(request);
    };
    server->rdma_stats_ = [raw] { return raw->stats(); };
  } else {
    internal_methods[rdma::kHelloMethod] =
        [no_rdma](const std::string&,
                  const std::string&) -> StatusOr<std::string> {
      return rdma::RdmaServerTransport::HelloUnavailable(no_rdma);
    };
    server->rdma_stats_ = [no_rdma] {
      RdmaServerStats stats;
      stats.status = absl::StrCat("no RDMA: ", no_rdma);
      return stats;
    };
  }
  // Calls may come in once the gRPC port is up, before the transports are
  // in place: a handler's Shutdown (or stats) waits for this lock, so it
  // sees them all. (Released before `server` goes on an error return.)
  std::lock_guard<std::mutex> built(server->mu_);
  RDMARPC_ASSIGN_OR_RETURN(
      auto grpc, grpc_transport::GrpcServerTransport::Start(
                     ports_,
                     {.port_reuse = port_reuse_,
                      .tls = tls_,
                      .keepalive_permit = keepalive_permit_,
                      .services = {server->service_names_.begin(),
                                   server->service_names_.end()},
                      .health = health_service_,
                      .reflection = reflection_,
                      .threads = grpc_threads_},
                     server->dispatcher_.get(), std::move(internal_methods)));
  grpc_transport::GrpcServerTransport* grpc_raw = grpc.get();
  server->set_serving_status_ = [grpc_raw](const std::string& service,
                                           bool serving) {
    return grpc_raw->SetServingStatus(service, serving);
  };
  server->transports_.push_back(std::move(grpc));
  if (rdma) server->transports_.push_back(std::move(rdma));
  return server;
}

Server::Server() = default;

Server::~Server() {
  Shutdown();
  Wait();
  if (shutdown_thread_.joinable()) shutdown_thread_.join();
}

void Server::Shutdown(std::chrono::system_clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_started_) return;
    shutdown_started_ = true;
    // One of our handlers asks: the shutdown waits for its call too, so it
    // goes on on a thread of its own. Made under mu_, which FinishShutdown
    // takes to say it is done, so ~Server sees the thread to join.
    if (dispatcher_ != nullptr && internal::RunningHandlerOf(*dispatcher_)) {
      try {
        shutdown_thread_ = std::thread([this, deadline] {
          pthread_setname_np(pthread_self(), "rdmarpc-stop");
          FinishShutdown(deadline);
        });
        return;
      } catch (const std::system_error&) {
        // No thread to be had: shut down here, as before, which waits
        // for this handler too and so returns only if something else
        // ends the handler's call.
      }
    }
  }
  FinishShutdown(deadline);
}

void Server::FinishShutdown(std::chrono::system_clock::time_point deadline) {
  if (dispatcher_) dispatcher_->CloseLogAt(deadline);
  for (auto& t : transports_) t->Shutdown(deadline);
  // Every call has completed; the workers are idle. The final counts stay
  // readable; the dispatcher leaves under mu_, which the stats take, and
  // ends (joining its workers) outside it.
  std::unique_ptr<internal::ServerDispatcher> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dispatcher_) {
      final_call_log_stats_ = CallLogStatsLocked();
      final_handler_stats_ = dispatcher_->handler_stats();
    }
    ended = std::move(dispatcher_);
  }
  ended.reset();
  // Notified under the lock: a waiter that wakes may destroy the server.
  std::lock_guard<std::mutex> lock(mu_);
  shutdown_done_ = true;
  cv_.notify_all();
}

Status Server::SetServingStatus(const std::string& service, bool serving) {
  if (!service.empty() && !service_names_.contains(service)) {
    return absl::NotFoundError(
        absl::StrCat("Server::SetServingStatus: the server runs no service ",
                     service, " (give its full name, e.g. demo.Inference)"));
  }
  // Under mu_, so that Shutdown() cannot take the transport away meanwhile.
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_started_) {
    return absl::FailedPreconditionError(
        "Server::SetServingStatus: the server is shutting down");
  }
  return set_serving_status_(service, serving);
}

RdmaServerStats Server::rdma_stats() const { return rdma_stats_(); }

CallLogStats Server::CallLogStatsLocked() const {
  if (!dispatcher_) return final_call_log_stats_;
  internal::CallLog::Stats log = dispatcher_->call_log_stats();
  CallLogStats stats;
  stats.calls_logged = log.records;
  stats.repeats_answered = log.repeats_answered;
  stats.repeats_refused = log.repeats_refused;
  return stats;
}

CallLogStats Server::call_log_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CallLogStatsLocked();
}

HandlerStats Server::handler_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dispatcher_ ? dispatcher_->handler_stats() : final_handler_stats_;
}

void Server::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return shutdown_done_; });
}

}  // namespace rdmarpc
