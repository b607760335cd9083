#include "runtime/thread_pool.h"

#include <pthread.h>

#include <cerrno>
#include <system_error>
#include <utility>

namespace rdmarpc::internal {
namespace {
// The kWhileBlocked pool the calling thread belongs to.
thread_local ThreadPool* current_pool = nullptr;
}  // namespace

ThreadPool::ThreadPool(int threads, const char* name, Growth growth)
    : wanted_(threads), name_(name), growth_(growth) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < threads; ++i) {
    if (!StartLocked() && alive_ == 0) {
      throw std::system_error(EAGAIN, std::generic_category(),
                              "no thread could be started for a pool");
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  // Tasks still queued may wait for tasks they post, so the pool may still
  // grow meanwhile; no thread leaves to left_ once stopping_ is set.
  {
    std::unique_lock<std::mutex> lock(mu_);
    gone_.wait(lock, [this] { return alive_ == 0; });
  }
  for (std::thread& t : threads_) t.join();
  for (std::thread& t : left_) t.join();
}

void ThreadPool::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    GrowIfStarvedLocked();
  }
  cv_.notify_one();
}

int ThreadPool::threads_for_test() {
  std::lock_guard<std::mutex> lock(mu_);
  return alive_;
}

ThreadPool::BlockedScope::BlockedScope() : pool_(current_pool) {
  if (pool_ == nullptr) return;
  std::lock_guard<std::mutex> lock(pool_->mu_);
  ++pool_->blocked_;
  pool_->GrowIfStarvedLocked();
}

ThreadPool::BlockedScope::~BlockedScope() {
  if (pool_ == nullptr) return;
  std::lock_guard<std::mutex> lock(pool_->mu_);
  --pool_->blocked_;
}

void ThreadPool::GrowIfStarvedLocked() {
  if (growth_ != Growth::kWhileBlocked) return;
  // A thread notified but not yet awake still counts as idle: compare the
  // queue with the idle threads, not with none.
  if (tasks_.size() <= static_cast<size_t>(idle_)) return;
  if (alive_ - blocked_ >= wanted_ || alive_ >= wanted_ + kMaxExtraThreads) {
    return;
  }
  // If no thread can be made now, the tasks wait for a thread to finish
  // (or for the next Post or BlockedScope to try again).
  (void)StartLocked();
}

bool ThreadPool::StartLocked() {
  Threads::iterator self = threads_.emplace(threads_.end());
  try {
    // Loop takes mu_ first, so it sees *self assigned.
    *self = std::thread([this, self] { Loop(self); });
  } catch (const std::system_error&) {
    threads_.erase(self);
    return false;
  }
  pthread_setname_np(self->native_handle(), name_);
  ++alive_;
  return true;
}

void ThreadPool::Loop(Threads::iterator self) {
  if (growth_ == Growth::kWhileBlocked) current_pool = this;
  std::unique_lock<std::mutex> lock(mu_);
  // The thread that left before this one, joined once this one unlocks.
  std::vector<std::thread> earlier;
  for (;;) {
    ++idle_;
    const auto ready = [this] { return stopping_ || !tasks_.empty(); };
    if (alive_ - blocked_ > wanted_) {
      // One more than needed outside calls: leave unless a task comes.
      if (!cv_.wait_for(lock, kLeaveAfter, ready) &&
          alive_ - blocked_ > wanted_) {
        --idle_;
        --alive_;
        earlier.swap(left_);
        left_.push_back(std::move(*self));
        threads_.erase(self);
        lock.unlock();
        current_pool = nullptr;
        // Each leaving thread joins the one before it (which has returned
        // from Loop by now, or is about to): at most one waits to be
        // joined, by the next to leave or by the destructor.
        for (std::thread& t : earlier) t.join();
        return;
      }
    } else {
      cv_.wait(lock, ready);
    }
    --idle_;
    if (tasks_.empty()) {
      if (stopping_) break;  // and the queue is drained
      continue;              // woken to leave, but the count went back
    }
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what it holds goes before the lock is taken
    lock.lock();
  }
  if (--alive_ == 0) gone_.notify_all();
  current_pool = nullptr;
}

}  // namespace rdmarpc::internal
