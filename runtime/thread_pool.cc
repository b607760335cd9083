#include "runtime/thread_pool.h"

#include <pthread.h>

#include <cerrno>
#include <system_error>
#include <utility>

namespace rdmarpc::internal {
namespace {
thread_local ThreadPool* current_pool = nullptr;
}  // namespace

ThreadPool::ThreadPool(int threads, const char* name)
    : wanted_(threads), name_(name) {
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
  if (tasks_.empty() || idle_ > 0) return;
  if (alive_ - blocked_ >= wanted_ || alive_ >= wanted_ + kMaxExtraThreads) {
    return;
  }
  StartLocked();
}

bool ThreadPool::StartLocked() {
  for (std::thread& t : left_) t.join();  // each has returned or is about to
  left_.clear();
  Threads::iterator self = threads_.emplace(threads_.end());
  try {
    // Loop takes mu_ first, so it sees *self assigned.
    *self = std::thread([this, self] { Loop(self); });
  } catch (const std::system_error&) {
    // No thread now: the tasks wait for one that finishes.
    threads_.erase(self);
    return false;
  }
  pthread_setname_np(self->native_handle(), name_);
  ++alive_;
  return true;
}

void ThreadPool::Loop(Threads::iterator self) {
  current_pool = this;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    --idle_;
    if (tasks_.empty()) break;  // stopping, and the queue is drained
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what it holds goes before the lock is taken
    lock.lock();
    // More threads than wanted outside calls: the waits that made the pool
    // grow are over, and this one goes.
    if (!stopping_ && alive_ - blocked_ > wanted_) {
      --alive_;
      left_.push_back(std::move(*self));
      threads_.erase(self);
      return;
    }
  }
  if (--alive_ == 0) gone_.notify_all();
}

}  // namespace rdmarpc::internal
