// The completion engine: one thread that makes progress on every RDMA
// connection of the process.
//
// The thread busy-polls the completion queues for the spin period (twice
// the process's recent round trip, 50 us to 2 ms, or RDMARPC_RDMA_SPIN_US;
// see runtime/spin.h) after the last completion it found,
// which keeps a stream of calls at the device's latency without a sleep and
// a wake-up per call; then it arms every queue and sleeps in epoll on their
// completion channels, so an idle process burns no CPU. The spin is timed
// with the CPU's cycle counter and takes no lock: a spinning engine makes no
// system call but a look at the devices' events every 10 ms.
//
//   std::shared_ptr<Connection> conn = ...;
//   Engine::Get().Add(conn);  // polled from now until it closes
//
// A caller blocked in Channel::Call polls its connection's queue itself
// while it spins (Connection::PollForCaller), so its response completes on
// its own thread; one thread polls a queue at a time, and the engine does
// not sleep while a caller holds one (it has not seen that queue since it
// armed it).
//
// Connections leave the engine when they close: the engine runs
// Connection::FinishClose on its thread and drops its reference.
//
// The engine also reads each device's asynchronous events: a QP fatal
// event closes that connection, a port error the connections on that port,
// a device fatal event every connection on the device, each with the event
// named as the trigger so channels fall back to gRPC at once.
#ifndef RDMARPC_TRANSPORT_RDMA_ENGINE_H_
#define RDMARPC_TRANSPORT_RDMA_ENGINE_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rdmarpc/status.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class Connection;

class Engine {
 public:
  // The process-wide engine, started on first use and never destroyed
  // (connections may close during static destruction).
  static Engine& Get();

  // Starts polling `conn`. UNAVAILABLE if its completion channel cannot be
  // watched.
  [[nodiscard]] Status Add(std::shared_ptr<Connection> conn);
  // Makes the thread look at its connections now (one closed, ...).
  void Wake();

  // Acts on one asynchronous event of `device` (closes the connections it
  // concerns). The engine calls it for each event it reads; tests call it
  // with synthetic events.
  void HandleAsyncEvent(ibv_context* device, const ibv_async_event& event);

  // For the calls' progress watch (rdma_client.cc): time the engine spent
  // inside one long pass over its connections (registering a large landing
  // buffer, for one) held every call of the process still, and that is no
  // fault of the path. Returns `now` while such a pass runs, else when the
  // last one ended: no call counts as still before it.
  std::chrono::steady_clock::time_point NotStillBefore(
      std::chrono::steady_clock::time_point now) const;

 private:
  Engine();
  void Loop();
  void ReadAsyncEvents(ibv_context* device);
  // Waits up to `timeout_ms` (-1: forever) for epoll and handles what it
  // reports: wake-ups, completion channels, device events.
  void HandleEpoll(int timeout_ms);
  // Stops watching devices no open connection uses. Requires mu_. Runs
  // before a closed connection's id is destroyed: destroying the last id on
  // a removed device frees its context.
  void ReleaseDevicesLocked();

  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  Status start_error_;  // why the engine could not start; Add returns it
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> added_;  // not yet picked up
  std::atomic<bool> added_pending_{false};          // added_ may be non-empty
  // Every connection the engine polls, for the async events.
  std::vector<std::weak_ptr<Connection>> live_;
  std::map<ibv_context*, bool> watched_devices_;  // value: fd still in epoll
  std::thread thread_;
  // SpinClock time the current pass over the connections began; 0 while
  // the engine sleeps.
  std::atomic<uint64_t> pass_began_{0};
  // steady_clock ticks (coarse) when the last long pass ended.
  std::atomic<std::chrono::steady_clock::rep> long_pass_ended_{0};
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ENGINE_H_
