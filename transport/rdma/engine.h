// The completion engine: one thread that makes progress on every RDMA
// connection of the process.
//
// While any connection has work pending (posted work requests, calls
// waiting for the peer) the thread busy-polls the completion queues, which
// keeps latency at the device's; once everything is quiet for the spin
// period (RDMARPC_RDMA_SPIN_US, default 50 us) it arms every queue and
// sleeps in epoll on their completion channels, so an idle process burns no
// CPU.
//
//   std::shared_ptr<Connection> conn = ...;
//   Engine::Get().Add(conn);  // polled from now until it closes
//
// Connections leave the engine when they close: the engine runs
// Connection::FinishClose on its thread and drops its reference.
#ifndef RDMARPC_TRANSPORT_RDMA_ENGINE_H_
#define RDMARPC_TRANSPORT_RDMA_ENGINE_H_

#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rdmarpc/status.h"

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

 private:
  Engine();
  void Loop();

  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::chrono::microseconds spin_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> added_;  // not yet picked up
  std::thread thread_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ENGINE_H_
