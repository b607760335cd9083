#include "transport/rdma/engine.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/coarse_clock.h"
#include "runtime/completion.h"
#include "runtime/fault_injection.h"
#include "runtime/spin.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {
namespace {

// epoll data: 0 is the wake eventfd, a pointer with the low bit set a
// device's async event fd, any other pointer a CompletionGroup.
constexpr uint64_t kDeviceTag = 1;

// How often a busy engine looks at the devices' asynchronous events.
constexpr std::chrono::milliseconds kAsyncEventPeriod(10);
// A pass over the connections longer than this held their calls still.
constexpr std::chrono::milliseconds kLongPass(100);
// How often the watchdog looks at a sleeping engine (a handler cannot hold
// it then, but the engine may wake and run one before the next look).
constexpr std::chrono::milliseconds kIdleWatchPeriod(100);
// Threads the engine may have, most of them stuck in handlers that blocked.
constexpr int kMaxEngineThreads = 16;

// The role generation this thread holds; 0: none.
thread_local uint64_t held_generation = 0;

// Every engine's connections, for the devices' async events, and the
// devices whose event fds the first engine watches.
struct DeviceWatch {
  std::mutex mu;
  std::vector<std::weak_ptr<Connection>> live;
  std::map<ibv_context*, bool> watched;  // value: fd still in epoll
};

DeviceWatch& Devices() {
  static auto* devices = new DeviceWatch();  // outlives every connection
  return *devices;
}

std::atomic<int> pollers_for_testing{0};

int Pollers() {
  static const int from_env = [] {
    const char* env = std::getenv("RDMARPC_RDMA_POLLERS");
    return env == nullptr ? 1 : std::atoi(env);
  }();
  const int wanted = pollers_for_testing.load(std::memory_order_relaxed);
  return std::clamp(wanted > 0 ? wanted : from_env, 1, Engine::kMaxPollers);
}

// The engines started so far; never destroyed.
struct Started {
  std::mutex mu;
  Engine* engines[Engine::kMaxPollers] = {};
  int count = 0;  // guarded by mu
  std::atomic<Engine*> first{nullptr};
};

Started& Engines() {
  static auto* started = new Started();
  return *started;
}

}  // namespace

StatusOr<CompletionGroup::Membership> Engine::Join(ibv_context* device,
                                                   bool serves,
                                                   uint32_t entries) {
  Started& started = Engines();
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(started.mu);
    const int pollers = Pollers();
    for (int i = 0; i < std::min(started.count, pollers); ++i) {
      Engine* e = started.engines[i];
      if (engine == nullptr ||
          e->connections_.load() < engine->connections_.load()) {
        engine = e;
      }
    }
    if (started.count < pollers &&
        (engine == nullptr || engine->connections_.load() > 0)) {
      auto fresh = std::unique_ptr<Engine>(new Engine());
      if (fresh->start_error_.ok()) {
        engine = fresh.release();
        started.engines[started.count++] = engine;
        if (started.count == 1) started.first.store(engine);
      } else if (engine == nullptr) {
        // No engine at all: RDMA is not used (nothing else in the process
        // is affected); a later connection tries again.
        return fresh->start_error_;
      }
      // Else the engines that did start take it.
    }
    // Counted at once, so that the next Join sees it; the membership's
    // end takes it back.
    engine->connections_.fetch_add(1);
  }
  auto joined = engine->JoinHere(device, serves, entries);
  if (!joined.ok()) engine->connections_.fetch_sub(1);
  return joined;
}

StatusOr<CompletionGroup::Membership> Engine::JoinHere(ibv_context* device,
                                                       bool serves,
                                                       uint32_t entries) {
  CompletionGroup::Membership member;
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(open_groups_, [](const auto& g) { return g->closed(); });
  for (const auto& group : open_groups_) {
    if (group->device() == device && group->serves() == serves &&
        group->TryJoin(entries, &member)) {
      return member;
    }
  }
  RDMARPC_ASSIGN_OR_RETURN(
      std::shared_ptr<CompletionGroup> group,
      CompletionGroup::Create(this, device, serves, static_cast<int>(entries),
                              epoll_fd_.get(), &connections_));
  if (!group->TryJoin(entries, &member)) {
    return absl::InternalError("a new completion group took no member");
  }
  open_groups_.push_back(group);
  // Polled from now on: the queue pair's first completions may come
  // before its connection is added.
  added_groups_.push_back(std::move(group));
  added_pending_.store(true, std::memory_order_release);
  Wake();
  return member;
}

Status Engine::Add(std::shared_ptr<Connection> conn) {
  CompletionGroup* group = conn->group();
  if (group == nullptr) {
    return absl::FailedPreconditionError(
        "the connection joined no completion group");
  }
  return group->engine()->AddHere(std::move(conn));
}

void Engine::SetPollersForTesting(int pollers) {
  pollers_for_testing.store(pollers, std::memory_order_relaxed);
}

Engine::Engine()
    : epoll_fd_(epoll_create1(EPOLL_CLOEXEC)),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  if (epoll_fd_.get() < 0 || wake_fd_.get() < 0 ||
      epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev) != 0) {
    // Add does not keep it (no thread started).
    start_error_ = VerbsError(
        "starting the RDMA completion engine (epoll, eventfd)", errno);
    return;
  }
  threads_ = 1;
  std::thread thread([this] { ThreadMain(/*holds_role=*/true); });
  pthread_setname_np(thread.native_handle(), "rdmarpc-engine");
  thread.detach();
}

Status Engine::AddHere(std::shared_ptr<Connection> conn) {
  conn->set_engine(this);
  // Its queue failed while it was being set up (the error event closed
  // only the connections added by then).
  if (conn->group()->broken()) {
    conn->Close(absl::UnavailableError(
                    "RDMA connection failed: its completion queue failed"),
                "CQ error event");
  }
  {
    DeviceWatch& devices = Devices();
    std::lock_guard<std::mutex> lock(devices.mu);
    Engines().first.load()->WatchDevice(conn->cm_id()->verbs);
    devices.live.push_back(conn);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    added_.push_back(std::move(conn));
  }
  added_pending_.store(true, std::memory_order_release);
  Wake();
  return absl::OkStatus();
}

void Engine::Wake() {
  uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));
}

void Engine::WakeForClose() {
  closes_pending_.store(true, std::memory_order_release);
  Wake();
}

void Engine::WatchDevice(ibv_context* device) {
  DeviceWatch& devices = Devices();
  if (device == nullptr || devices.watched.contains(device)) return;
  int flags = fcntl(device->async_fd, F_GETFL);
  epoll_event dev{};
  dev.events = EPOLLIN;
  dev.data.u64 = reinterpret_cast<uintptr_t>(device) | kDeviceTag;
  devices.watched[device] =
      flags >= 0 && fcntl(device->async_fd, F_SETFL, flags | O_NONBLOCK) == 0 &&
      epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, device->async_fd, &dev) == 0;
}

void Engine::ReadAsyncEvents(ibv_context* device) {
  DeviceWatch& devices = Devices();
  while (true) {
    AsyncEventHit hit;
    bool fatal = false;
    {
      // Another engine may release the device (and its last connection
      // free it) once it is unwatched: it is read only while watched.
      std::lock_guard<std::mutex> lock(devices.mu);
      auto it = devices.watched.find(device);
      if (it == devices.watched.end() || !it->second) return;
      ibv_async_event event;
      if (ibv_get_async_event(device, &event) != 0) return;
      hit = MatchLocked(device, event);
      fatal = event.event_type == IBV_EVENT_DEVICE_FATAL;
      ibv_ack_async_event(&event);
      if (fatal) {
        // The fd stays readable on a dead device; stop watching it. An
        // error only means the fd is gone already.
        (void)epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, device->async_fd,
                        nullptr);
        it->second = false;
      }
    }
    for (auto& c : hit.conns) c->Close(hit.why, hit.trigger);
    if (fatal) return;
  }
}

void Engine::HandleAsyncEvent(ibv_context* device,
                              const ibv_async_event& event) {
  AsyncEventHit hit;
  {
    std::lock_guard<std::mutex> lock(Devices().mu);
    hit = MatchLocked(device, event);
  }
  for (auto& c : hit.conns) c->Close(hit.why, hit.trigger);
}

Engine::AsyncEventHit Engine::MatchLocked(ibv_context* device,
                                          const ibv_async_event& event) {
  std::vector<std::shared_ptr<Connection>> hit;
  const char* trigger = nullptr;
  std::string what;
  for (const auto& weak : Devices().live) {
    auto c = weak.lock();
    if (!c || c->cm_id()->verbs != device) continue;
    switch (event.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        if (c->cm_id()->qp == event.element.qp) hit.push_back(c);
        trigger = "QP fatal event";
        break;
      case IBV_EVENT_CQ_ERR:
        if (c->cq() == event.element.cq) {
          c->group()->MarkBroken();
          hit.push_back(c);
        }
        trigger = "CQ error event";
        break;
      case IBV_EVENT_PORT_ERR:
        if (c->cm_id()->port_num == event.element.port_num) {
          hit.push_back(c);
        }
        trigger = "port error event";
        what = absl::StrCat(" (port ", event.element.port_num, ")");
        break;
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        // Not a failure: a closing connection may now be torn down.
        if (c->cm_id()->qp == event.element.qp) c->NoteLastSharedReceive();
        break;
      case IBV_EVENT_DEVICE_FATAL:
        hit.push_back(c);
        trigger = "device fatal event";
        break;
      default:
        break;
    }
  }
  return {std::move(hit),
          absl::UnavailableError(absl::StrCat(
              "RDMA device ", ibv_get_device_name(device->device), " reported ",
              ibv_event_type_str(event.event_type), what)),
          trigger};
}

void Engine::ReleaseDevices() {
  DeviceWatch& devices = Devices();
  std::lock_guard<std::mutex> lock(devices.mu);
  const int epoll_fd = Engines().first.load()->epoll_fd_.get();
  std::map<ibv_context*, int> users;
  for (auto it = devices.live.begin(); it != devices.live.end();) {
    auto c = it->lock();
    // A closed connection not finished yet may wait for its queue pair's
    // last-WQE event: it keeps its device watched.
    if (!c || c->finished()) {
      it = devices.live.erase(it);
      continue;
    }
    ++users[c->cm_id()->verbs];
    ++it;
  }
  for (auto it = devices.watched.begin(); it != devices.watched.end();) {
    if (users.contains(it->first)) {
      ++it;
      continue;
    }
    if (it->second) {
      (void)epoll_ctl(epoll_fd, EPOLL_CTL_DEL, it->first->async_fd,
                      nullptr);  // an error: the fd is gone already
    }
    it = devices.watched.erase(it);
  }
}

void Engine::ThreadMain(bool holds_role) {
  if (holds_role) {
    held_generation = 1;
    holder_generation_ = 1;
    role_.store(uint64_t{1} << kGenerationShift | kPolling,
                std::memory_order_release);
  }
  while (true) {
    if (!holds_role) TakeRole();
    holds_role = false;
    internal::SetThreadPoller(this);
    internal::MarkCompletionThread(true);
    Loop();
    internal::MarkCompletionThread(false);
    internal::SetThreadPoller(nullptr);
    held_generation = 0;
  }
}

void Engine::TakeRole() {
  std::unique_lock<std::mutex> lock(standby_mu_);
  ++standby_;
  standby_cv_.wait(lock, [this] { return role_free_; });
  --standby_;
  role_free_ = false;
  // The last holder gave the role up and touches no loop state any more.
  held_generation =
      (role_.load(std::memory_order_acquire) >> kGenerationShift) + 1;
  holder_generation_ = held_generation;
  role_.store(held_generation << kGenerationShift | kPolling,
              std::memory_order_release);
}

void Engine::PassRole() {
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(standby_mu_);
    role_free_ = true;
    // At the limit the role waits for a thread whose handler returns.
    if (standby_ == 0 && threads_ < kMaxEngineThreads) {
      ++threads_;
      start = true;
    }
  }
  if (!start) {
    standby_cv_.notify_one();
    return;
  }
  std::thread thread([this] { ThreadMain(/*holds_role=*/false); });
  pthread_setname_np(thread.native_handle(), "rdmarpc-engine");
  thread.detach();
}

void Engine::RunAfterBatch(void (*drain)()) {
  for (int i = 0; i < drain_count_; ++i) {
    if (drains_[i] == drain) return;
  }
  if (drain_count_ == kMaxDrains) {
    drain();  // more kinds of work than the runtime has; never seen
    return;
  }
  drains_[drain_count_++] = drain;
  if (!watching_.load(std::memory_order_relaxed) && !watching_.exchange(true)) {
    std::thread watch([this] { Watch(); });
    pthread_setname_np(watch.native_handle(), "rdmarpc-watch");
    watch.detach();
  }
}

bool Engine::Drain() {
  if (drain_count_ == 0) return true;
  // Taken before the role can move: the next holder queues its own.
  void (*drains[kMaxDrains])();
  const int count = drain_count_;
  std::copy_n(drains_, count, drains);
  drain_count_ = 0;
  drain_number_ = (drain_number_ + 1) & kDrainNumberMask;
  const uint64_t held = holder_generation_ << kGenerationShift | drain_number_
                                                                     << 2;
  role_.store(held | kDraining, std::memory_order_release);
  // No queue is held now: what the drains run may block once it has
  // handed the role on (LeaveBeforeBlocking).
  internal::MarkCompletionThread(false);
  for (int i = 0; i < count; ++i) drains[i]();
  uint64_t expected = held | kDraining;
  if (role_.compare_exchange_strong(expected, held | kPolling,
                                    std::memory_order_acq_rel)) {
    internal::MarkCompletionThread(true);
    return true;
  }
  return false;  // another thread holds the role, and the loop state
}

bool Engine::LeaveBeforeBlocking() {
  if (held_generation == 0 || internal::OnCompletionThread()) return false;
  uint64_t role = role_.load(std::memory_order_acquire);
  if (role >> kGenerationShift == held_generation &&
      (role & kPhaseMask) == kDraining &&
      role_.compare_exchange_strong(role, (role & ~kPhaseMask) | kGivenUp,
                                    std::memory_order_acq_rel)) {
    PassRole();
  }
  // Otherwise the watchdog took it already.
  return true;
}

void Engine::Watch() {
  uint64_t last_seen = 0;
  while (true) {
    std::this_thread::sleep_for(pass_began_.load(std::memory_order_relaxed) == 0
                                    ? kIdleWatchPeriod
                                    : kHandOffAfter);
    // The same drain (generation and drain number) on two looks, at least
    // kHandOffAfter apart: a handler holds the engine. Its connections go
    // on without it.
    uint64_t role = role_.load(std::memory_order_acquire);
    if ((role & kPhaseMask) == kDraining && role == last_seen &&
        role_.compare_exchange_strong(role, (role & ~kPhaseMask) | kGivenUp,
                                      std::memory_order_acq_rel)) {
      PassRole();
    }
    last_seen = role;
  }
}

void Engine::Loop() {
  const internal::SpinClock& clock = internal::SpinClock::Get();
  const uint64_t event_period = clock.Ticks(kAsyncEventPeriod);
  const uint64_t long_pass = clock.Ticks(kLongPass);
  last_progress_ = clock.Now();
  loop_pass_began_ = last_progress_;
  if (last_events_ == 0) last_events_ = last_progress_;
  pass_began_.store(loop_pass_began_, std::memory_order_relaxed);
  while (true) {
    if (added_pending_.exchange(false, std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : added_) conns_.push_back(std::move(c));
      added_.clear();
      for (auto& g : added_groups_) groups_.push_back(std::move(g));
      added_groups_.clear();
      // One closed before it had an engine to tell.
      closes_pending_.store(true, std::memory_order_relaxed);
    }
    bool progress = false;
    for (size_t i = 0; i < groups_.size();) {
      CompletionGroup* group = groups_[i].get();
      // kBusy (a caller polls it for its own call) is no progress: the
      // engine may sleep meanwhile, and the caller wakes it if it leaves a
      // call unpolled (CompletionGroup::ArmForSleep).
      progress |= group->TryPoll() == CompletionGroup::PollResult::kFound;
      if (!Drain()) return;
      if (group->released()) {
        // Its channel left epoll before this: no later wait names it.
        groups_[i] = std::move(groups_.back());
        groups_.pop_back();
        continue;
      }
      ++i;
    }
    const bool closes =
        closes_pending_.exchange(false, std::memory_order_acq_rel);
    for (size_t i = 0; closes && i < conns_.size();) {
      Connection* c = conns_[i].get();
      if (c->closed()) {
        if (!c->FinishClose()) {  // a caller holds its group
          closes_pending_.store(true, std::memory_order_relaxed);
          progress = true;
          ++i;
          continue;
        }
        // Before the last reference goes: destroying the last id on a
        // removed device closes the device, and its async fd with it.
        ReleaseDevices();
        conns_[i] = std::move(conns_.back());
        conns_.pop_back();
        // Set before the drains: if they hand the loop on, its next holder
        // looks at the rest (the role's hand-over publishes the store).
        closes_pending_.store(true, std::memory_order_relaxed);
        if (!Drain()) return;
        continue;
      }
      ++i;
    }
    // Fault injection: a test holds a pass that found nothing, on its way
    // to sleep, to add connections meanwhile.
    if (!progress) {
      internal::fault::HoldWhileArmed("rdma.engine.hold_idle_pass",
                                      "rdma.engine.idle_pass_held");
    }
    uint64_t now = clock.Now();
    if (now - loop_pass_began_ >= long_pass) {
      long_pass_ended_.store(
          internal::CoarseSteadyNow().time_since_epoch().count(),
          std::memory_order_relaxed);
    }
    loop_pass_began_ = now;
    pass_began_.store(now, std::memory_order_relaxed);
    // Busy or not, async events (a port going down) must not wait long.
    if (now - last_events_ >= event_period) {
      last_events_ = now;
      HandleEpoll(0);
    }
    if (progress) {
      last_progress_ = now;
      continue;
    }
    // Spinning on after the last completion catches the next request or
    // response without a sleep and a wake-up through the kernel.
    if (now - last_progress_ < internal::EngineSpinTicks()) {
      internal::CpuRelax();
      continue;
    }
    // Quiet: complete the frames left unsignaled whose `sent` waits (their
    // flush write's completion comes while spinning), then arm the queues,
    // each polled once more under the same hold to catch what raced with
    // arming, and sleep.
    for (auto& c : conns_) {
      if (c->wants_flush()) progress |= c->FlushUnsignaled();
    }
    if (progress) {
      last_progress_ = now;
      continue;
    }
    // A client group where no call awaits, or that a caller holds, stays
    // unarmed; a server group someone holds is looked at again first.
    for (size_t i = 0; i < groups_.size(); ++i) {
      progress |= !groups_[i]->ArmForSleep();
      if (!Drain()) return;
    }
    if (progress) continue;
    if (!Drain()) return;
    pass_began_.store(0, std::memory_order_relaxed);
    HandleEpoll(-1);
    last_progress_ = clock.Now();
    loop_pass_began_ = last_progress_;
    pass_began_.store(loop_pass_began_, std::memory_order_relaxed);
  }
}

std::chrono::steady_clock::time_point Engine::NotStillBefore(
    const Connection* conn, std::chrono::steady_clock::time_point now) {
  const Engine* engine = conn->engine();
  if (engine == nullptr) return {};
  return engine->NotStillBeforeHere(now);
}

std::chrono::steady_clock::time_point Engine::NotStillBeforeHere(
    std::chrono::steady_clock::time_point now) const {
  const internal::SpinClock& clock = internal::SpinClock::Get();
  uint64_t began = pass_began_.load(std::memory_order_relaxed);
  if (began != 0 && clock.Now() - began >= clock.Ticks(kLongPass)) return now;
  return std::chrono::steady_clock::time_point(
      std::chrono::steady_clock::duration(
          long_pass_ended_.load(std::memory_order_relaxed)));
}

void Engine::HandleEpoll(int timeout_ms) {
  epoll_event events[64];
  int n = epoll_wait(epoll_fd_.get(), events, 64, timeout_ms);
  for (int i = 0; i < n; ++i) {
    uint64_t data = events[i].data.u64;
    if (data == 0) {
      // Drained only by the sleep's wait, after which the loop re-reads
      // what the wake-up announces (added or closed connections). Drained
      // by the busy loop's look, it could be swallowed after those checks
      // and before the sleep, which then never ended for them.
      if (timeout_ms != 0) {
        uint64_t count;
        (void)!read(wake_fd_.get(), &count, sizeof(count));
      }
    } else if (data & kDeviceTag) {
      ReadAsyncEvents(reinterpret_cast<ibv_context*>(data & ~kDeviceTag));
    } else {
      static_cast<CompletionGroup*>(events[i].data.ptr)->ConsumeEvents();
    }
  }
}

}  // namespace rdmarpc::rdma
