// The completion engines: threads that make progress on the process's RDMA
// connections, each engine on the connections it was given.
//
// An engine's connections on a device share completion queues, about 40
// to a queue, client and server connections apart (completion_group.h).
// It busy-polls them for the spin
// period (twice the process's recent round trip, 50 us to 2 ms, or
// RDMARPC_RDMA_SPIN_US; see runtime/spin.h) after the last completion it
// found, which keeps a stream of calls at the device's latency without a
// sleep and a wake-up per call; then it arms every queue and sleeps in epoll
// on their completion channels, so an idle process burns no CPU. The spin
// is timed with the CPU's cycle counter and takes no lock: a spinning
// engine makes no system call but a look at epoll every 10 ms.
//
//   // Setup (connection_setup.cc): the queue pair's completion queue.
//   RDMARPC_ASSIGN_OR_RETURN(resources.group,
//                            Engine::Join(id->verbs, serves, entries));
//   ...
//   RDMARPC_RETURN_IF_ERROR(Engine::Add(conn));  // polled until it closes
//
// The process has RDMARPC_RDMA_POLLERS engines (default 1, at most
// kMaxPollers), started as connections need them: a new connection joins
// the one with the fewest, and stays there. Connections of different
// engines make progress in parallel (a client and a server in one process
// each get one); those of one engine share its thread.
//
// A caller blocked in Channel::Call polls its connection's group itself
// while it spins (Connection::TakeForCaller), so its response completes on
// its own thread; one thread polls a group at a time. The engine arms a
// client group only where a call awaits a completion that no caller polls
// for, and may sleep while a caller holds one: a caller that stops polling
// with a call left awaiting wakes it (completion_group.h). So blocking
// calls made one after another cost their engine nothing. (A group armed
// for another call whose event comes while a caller holds it still keeps
// the engine spinning until the caller gives it back: only a holder reads
// the event.)
//
// Connections leave their engine when they close: the engine runs
// Connection::FinishClose on its thread and drops its reference.
//
// Server handlers that run on an engine (the default) run after the batch
// of completions that delivered them, with no connection's queue held
// (internal::PollerHooks::RunAfterBatch). An engine is a role, not a
// thread: a handler that blocks does not stall its connections for long.
// One that is about to block in a call of ours (Channel::Call) hands the
// role to a standby thread at once (LeaveBeforeBlocking); one that holds it
// longer than kHandOffAfter (10-20 ms: the engine's watchdog thread,
// `rdmarpc-watch`, sees the same drain on two looks kHandOffAfter apart)
// loses it to the watchdog, which hands it on: a sleep, a lock, a loop
// waiting for its own cancel. The thread that lost the role finishes its
// handlers and then waits as a standby.
//
// The first engine also reads each device's asynchronous events, for every
// engine's connections: a QP fatal event closes that connection, a port
// error the connections on that port, a device fatal event every
// connection on the device, each with the event named as the trigger so
// channels fall back to gRPC at once.
#ifndef RDMARPC_TRANSPORT_RDMA_ENGINE_H_
#define RDMARPC_TRANSPORT_RDMA_ENGINE_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rdmarpc/status.h"
#include "runtime/completion.h"
#include "transport/rdma/completion_group.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class Connection;

class Engine final : public internal::PollerHooks {
 public:
  // A handler run by an engine that holds it this long (up to twice) loses
  // it to another thread.
  static constexpr std::chrono::milliseconds kHandOffAfter{10};
  // Engines a process may have (RDMARPC_RDMA_POLLERS is clamped to it).
  static constexpr int kMaxPollers = 16;

  // A place for a new queue pair on `device` in a completion group of the
  // engine with the fewest connections (starting it if need be; engines
  // are never destroyed: connections may close during static
  // destruction), with `entries` of its queue: a group with room, else a
  // new one. `serves`: the queue pair will serve calls (a server's
  // connection), not make them.
  [[nodiscard]] static StatusOr<CompletionGroup::Membership> Join(
      ibv_context* device, bool serves, uint32_t entries);
  // Hands `conn` (whose resources joined a group) to the engine of its
  // group, which finishes its close. Its completions reach it from its
  // Create on.
  [[nodiscard]] static Status Add(std::shared_ptr<Connection> conn);

  // Acts on one asynchronous event of `device` (closes the connections it
  // concerns, on any engine). The first engine calls it for each event it
  // reads; tests call it with synthetic events.
  static void HandleAsyncEvent(ibv_context* device,
                               const ibv_async_event& event);

  // For the calls' progress watch (rdma_client.cc): time `conn`'s engine
  // spent inside one long pass over its connections (registering a large
  // landing buffer, for one) held every call there still, and that is no
  // fault of the path. Returns `now` while such a pass runs, else when the
  // last one ended: no call counts as still before it.
  static std::chrono::steady_clock::time_point NotStillBefore(
      const Connection* conn, std::chrono::steady_clock::time_point now);

  // How many engines new connections are spread over; 0 restores
  // RDMARPC_RDMA_POLLERS. Engines already started keep their connections.
  static void SetPollersForTesting(int pollers);

  // Makes the engine's thread look at its connections now (one closed, ...).
  void Wake();
  // Wakes it to finish a connection's close: the loop looks for closed
  // connections only after this (or after adding some), not on every pass.
  void WakeForClose();

  // internal::PollerHooks, on the thread that holds the role.
  void RunAfterBatch(void (*drain)()) override;
  bool LeaveBeforeBlocking() override;

 private:
  // The role word: generation << 32 | drain number << 2 | phase. A
  // generation per holding, a drain number per drain of it.
  enum Phase : uint64_t { kPolling = 0, kDraining = 1, kGivenUp = 2 };
  static constexpr uint64_t kPhaseMask = 3;
  static constexpr int kGenerationShift = 32;
  static constexpr uint64_t kDrainNumberMask = (uint64_t{1} << 30) - 1;

  Engine();
  StatusOr<CompletionGroup::Membership> JoinHere(ibv_context* device,
                                                 bool serves, uint32_t entries);
  Status AddHere(std::shared_ptr<Connection> conn);
  // A thread of the engine: holds the role when given it, else waits.
  void ThreadMain(bool holds_role);
  // Polls until this thread loses the role.
  void Loop();
  // Runs what RunAfterBatch queued; false if the role went to another
  // thread meanwhile (the caller then touches no loop state).
  bool Drain();
  // Gives the free role to a standby thread, starting one if none waits.
  void PassRole();
  void TakeRole();
  void Watch();
  // What one async event closes, and why.
  struct AsyncEventHit {
    std::vector<std::shared_ptr<Connection>> conns;
    Status why;
    const char* trigger = nullptr;
  };
  // Requires DeviceWatch's lock (engine.cc).
  static AsyncEventHit MatchLocked(ibv_context* device,
                                   const ibv_async_event& event);
  // First engine only: the devices' event fds are in its epoll.
  void WatchDevice(ibv_context* device);
  void ReadAsyncEvents(ibv_context* device);
  // Stops watching devices no open connection of any engine uses. Runs
  // before a closed connection's id is destroyed: destroying the last id
  // on a removed device frees its context.
  static void ReleaseDevices();
  // Waits up to `timeout_ms` (-1: forever) for epoll and handles what it
  // reports: wake-ups, completion groups' channels, device events.
  void HandleEpoll(int timeout_ms);
  std::chrono::steady_clock::time_point NotStillBeforeHere(
      std::chrono::steady_clock::time_point now) const;

  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  Status start_error_;  // why the engine could not start (Add drops it)
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> added_;  // not yet picked up
  std::vector<std::shared_ptr<CompletionGroup>> added_groups_;  // the same
  // added_ or added_groups_ may be non-empty.
  std::atomic<bool> added_pending_{false};
  // A connection of conns_ (or one being added) may have closed.
  std::atomic<bool> closes_pending_{false};
  // Groups that may take members (mu_).
  std::vector<std::shared_ptr<CompletionGroup>> open_groups_;
  // Members of this engine's groups: where Join sends a new one.
  std::atomic<int> connections_{0};
  // Loop state: touched only by the thread holding the role (handed over
  // through standby_mu_ and role_).
  std::vector<std::shared_ptr<CompletionGroup>> groups_;
  std::vector<std::shared_ptr<Connection>> conns_;
  uint64_t last_progress_ = 0;
  uint64_t last_events_ = 0;
  uint64_t loop_pass_began_ = 0;
  uint64_t holder_generation_ = 0;
  uint64_t drain_number_ = 0;
  // What RunAfterBatch queued (distinct functions; the runtime has one).
  static constexpr int kMaxDrains = 4;
  void (*drains_[kMaxDrains])() = {};
  int drain_count_ = 0;

  std::atomic<uint64_t> role_{0};
  std::atomic<bool> watching_{false};
  std::mutex standby_mu_;
  std::condition_variable standby_cv_;
  bool role_free_ = false;  // guarded by standby_mu_
  int standby_ = 0;         // threads waiting for the role; standby_mu_
  int threads_ = 0;         // threads of the engine; standby_mu_
  // SpinClock time the current pass over the connections began; 0 while
  // the engine sleeps.
  std::atomic<uint64_t> pass_began_{0};
  // steady_clock ticks (coarse) when the last long pass ended.
  std::atomic<std::chrono::steady_clock::rep> long_pass_ended_{0};
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ENGINE_H_
