#include "transport/rdma/engine.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>

#include "transport/rdma/connection.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {
namespace {

std::chrono::microseconds SpinFromEnvironment() {
  const char* env = std::getenv("RDMARPC_RDMA_SPIN_US");
  if (env == nullptr || *env == '\0') return std::chrono::microseconds(50);
  return std::chrono::microseconds(std::strtoul(env, nullptr, 10));
}

}  // namespace

Engine& Engine::Get() {
  static Engine* engine = new Engine();
  return *engine;
}

Engine::Engine() : spin_(SpinFromEnvironment()) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  thread_ = std::thread([this] { Loop(); });
  thread_.detach();
}

Status Engine::Add(std::shared_ptr<Connection> conn) {
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    return VerbsError("starting the RDMA completion engine (epoll/eventfd)",
                      EMFILE);
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = conn.get();
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn->completion_fd(), &ev) != 0) {
    return VerbsError("watching a completion channel (epoll_ctl)", errno);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    added_.push_back(std::move(conn));
  }
  Wake();
  return absl::OkStatus();
}

void Engine::Wake() {
  uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void Engine::Loop() {
  std::vector<std::shared_ptr<Connection>> conns;
  auto last_progress = std::chrono::steady_clock::now();
  epoll_event events[64];
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : added_) conns.push_back(std::move(c));
      added_.clear();
    }
    bool progress = false;
    bool busy = false;
    for (size_t i = 0; i < conns.size();) {
      Connection* c = conns[i].get();
      progress |= c->Poll();
      if (c->closed()) {
        epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->completion_fd(), nullptr);
        c->FinishClose();
        conns[i] = std::move(conns.back());
        conns.pop_back();
        continue;
      }
      busy = busy || c->Busy();
      ++i;
    }
    auto now = std::chrono::steady_clock::now();
    if (progress) {
      last_progress = now;
      continue;
    }
    if (busy && now - last_progress < spin_) continue;
    // Quiet: arm every queue, catch what raced with arming, then sleep.
    for (auto& c : conns) c->Arm();
    for (auto& c : conns) progress |= c->Poll();
    if (progress) continue;
    int n = epoll_wait(epoll_fd_, events, 64, -1);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.ptr == nullptr) {
        uint64_t count;
        (void)!read(wake_fd_, &count, sizeof(count));
        continue;
      }
      static_cast<Connection*>(events[i].data.ptr)->ConsumeEvents();
    }
    last_progress = std::chrono::steady_clock::now();
  }
}

}  // namespace rdmarpc::rdma
