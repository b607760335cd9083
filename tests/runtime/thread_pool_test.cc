#include "runtime/thread_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rdmarpc::internal {
namespace {

constexpr auto kGrows = ThreadPool::Growth::kWhileBlocked;

// Posts tasks 0..depth-1 one from the other: each waits, in a BlockedScope,
// for the one it posted to finish, as a handler waits for a call into its
// own server. With a fixed pool the deepest would never get a thread.
// Tasks hold the chain, and a chain given up (WaitAll timed out) lets its
// waits and queued tasks return, so a failing test fails rather than hangs.
class Chain : public std::enable_shared_from_this<Chain> {
 public:
  Chain(ThreadPool* pool, int depth) : pool_(pool), done_(depth, false) {}

  void Start() {
    pool_->Post([self = shared_from_this()] { self->Run(0); });
  }
  // True once every task finished; false, giving up, after 15 s (the
  // binary's ctest timeout is 60 s: a stuck chain fails, not times out).
  bool WaitAll() {
    std::unique_lock<std::mutex> lock(mu_);
    const bool all = cv_.wait_for(lock, std::chrono::seconds(15), [this] {
      for (bool d : done_) {
        if (!d) return false;
      }
      return true;
    });
    if (!all) abandoned_ = true;
    cv_.notify_all();
    return all;
  }

 private:
  void Run(int level) {
    if (level + 1 < static_cast<int>(done_.size())) {
      pool_->Post([self = shared_from_this(), level] { self->Run(level + 1); });
      ThreadPool::BlockedScope blocked;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_[level + 1] || abandoned_; });
    }
    std::lock_guard<std::mutex> lock(mu_);
    done_[level] = true;
    cv_.notify_all();
  }

  ThreadPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> done_;
  bool abandoned_ = false;
};

// The pool is back to its size once the waits are over: threads beyond it
// leave after ThreadPool::kLeaveAfter without a task. (Polled, up to 10 s.)
bool ShrinksTo(ThreadPool* pool, int threads) {
  for (int i = 0; i < 1000; ++i) {
    if (pool->threads_for_test() == threads) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(ThreadPoolTest, TasksWaitingForTasksTheyPostedAllFinish) {
  ThreadPool pool(2, "pool-test", kGrows);
  EXPECT_EQ(pool.threads_for_test(), 2);
  auto first = std::make_shared<Chain>(&pool, 8);
  auto second = std::make_shared<Chain>(&pool, 8);
  first->Start();
  second->Start();
  EXPECT_TRUE(first->WaitAll());
  EXPECT_TRUE(second->WaitAll());
  EXPECT_TRUE(ShrinksTo(&pool, 2)) << pool.threads_for_test();
}

TEST(ThreadPoolTest, ItGrowsAgainAfterShrinking) {
  ThreadPool pool(1, "pool-test", kGrows);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    auto chain = std::make_shared<Chain>(&pool, 5);
    chain->Start();
    ASSERT_TRUE(chain->WaitAll());
    EXPECT_TRUE(ShrinksTo(&pool, 1)) << pool.threads_for_test();
  }
}

// A latch a task waits on (held by the task, so a test that gives up
// leaves nothing dangling).
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void Open() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(15), [this] { return open; });
  }
};

// Runs `task` on `pool` and waits for it.
void RunOn(ThreadPool* pool, std::function<void()> task) {
  auto ran = std::make_shared<Gate>();
  pool->Post([ran, task = std::move(task)] {
    task();
    ran->Open();
  });
  ASSERT_TRUE(ran->Wait());
}

// The pool's only thread is busy and a task is queued: a wait marked on a
// thread that is not the pool's starts none.
TEST(ThreadPoolTest, OffAPoolTheScopeChangesNothing) {
  ThreadPool pool(1, "pool-test", kGrows);
  auto busy = std::make_shared<Gate>();
  auto started = std::make_shared<Gate>();
  pool.Post([busy, started] {
    started->Open();
    busy->Wait();
  });
  ASSERT_TRUE(started->Wait());
  pool.Post([] {});
  {
    ThreadPool::BlockedScope blocked;
    EXPECT_EQ(pool.threads_for_test(), 1);
  }
  busy->Open();
  RunOn(&pool, [] {});
  EXPECT_EQ(pool.threads_for_test(), 1);
}

// The pool grows only for tasks that would otherwise wait.
TEST(ThreadPoolTest, AWaitWithNothingQueuedStartsNoThread) {
  ThreadPool pool(1, "pool-test", kGrows);
  int threads_in_scope = 0;
  RunOn(&pool, [&] {
    ThreadPool::BlockedScope blocked;
    threads_in_scope = pool.threads_for_test();
  });
  EXPECT_EQ(threads_in_scope, 1);
}

// A fixed pool keeps its threads: a task queued behind a waiting one runs
// after it.
TEST(ThreadPoolTest, AFixedPoolDoesNotGrow) {
  // Declared before the pool: its destructor may run the second task.
  bool second_ran_first = true;
  bool second_ran = false;
  int threads_in_scope = 0;
  ThreadPool pool(1, "pool-test");
  RunOn(&pool, [&] {
    pool.Post([&] { second_ran = true; });
    ThreadPool::BlockedScope blocked;
    threads_in_scope = pool.threads_for_test();
    second_ran_first = second_ran;  // only this thread could run it
  });
  RunOn(&pool, [] {});  // one thread, in order: the second task ran
  EXPECT_EQ(threads_in_scope, 1);
  EXPECT_FALSE(second_ran_first);
  EXPECT_TRUE(second_ran);
}

// The destructor runs what is queued, including tasks that wait for tasks.
TEST(ThreadPoolTest, DestroyingThePoolFinishesTheChains) {
  auto pool = std::make_unique<ThreadPool>(1, "pool-test", kGrows);
  auto chain = std::make_shared<Chain>(pool.get(), 4);
  chain->Start();
  // Waits from another thread: a chain that cannot finish is given up
  // there, and the destructor, waiting for it, returns.
  bool finished = false;
  std::thread waiter([&] { finished = chain->WaitAll(); });
  pool.reset();
  waiter.join();
  EXPECT_TRUE(finished);
}

}  // namespace
}  // namespace rdmarpc::internal
