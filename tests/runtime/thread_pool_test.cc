#include "runtime/thread_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rdmarpc::internal {
namespace {

// Posts tasks 0..depth-1 one from the other: each waits, in a BlockedScope,
// for the one it posted to finish, as a handler waits for a call into its
// own server. With a fixed pool the deepest would never get a thread.
class Chain {
 public:
  Chain(ThreadPool* pool, int depth) : pool_(pool), done_(depth, false) {}

  void Start() {
    pool_->Post([this] { Run(0); });
  }
  // True once every task finished, false after 60 s (a stuck chain).
  bool WaitAll() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [this] {
      for (bool d : done_) {
        if (!d) return false;
      }
      return true;
    });
  }

 private:
  void Run(int level) {
    if (level + 1 < static_cast<int>(done_.size())) {
      pool_->Post([this, level] { Run(level + 1); });
      ThreadPool::BlockedScope blocked;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_[level + 1]; });
    }
    std::lock_guard<std::mutex> lock(mu_);
    done_[level] = true;
    cv_.notify_all();
  }

  ThreadPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> done_;
};

// The pool is back to its size once the waits are over: each thread that
// waited leaves when its task returns. (Polled: the leaving thread checks
// after its task returned.)
bool ShrinksTo(ThreadPool* pool, int threads) {
  for (int i = 0; i < 6000; ++i) {
    if (pool->threads_for_test() == threads) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(ThreadPoolTest, TasksWaitingForTasksTheyPostedAllFinish) {
  ThreadPool pool(2, "pool-test");
  EXPECT_EQ(pool.threads_for_test(), 2);
  Chain first(&pool, 8);
  Chain second(&pool, 8);
  first.Start();
  second.Start();
  EXPECT_TRUE(first.WaitAll());
  EXPECT_TRUE(second.WaitAll());
  EXPECT_TRUE(ShrinksTo(&pool, 2)) << pool.threads_for_test();
}

TEST(ThreadPoolTest, ItGrowsAgainAfterShrinking) {
  ThreadPool pool(1, "pool-test");
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    Chain chain(&pool, 5);
    chain.Start();
    ASSERT_TRUE(chain.WaitAll());
    EXPECT_TRUE(ShrinksTo(&pool, 1)) << pool.threads_for_test();
  }
}

TEST(ThreadPoolTest, OffAPoolTheScopeChangesNothing) {
  ThreadPool pool(1, "pool-test");
  { ThreadPool::BlockedScope blocked; }  // this thread is not the pool's
  EXPECT_EQ(pool.threads_for_test(), 1);
  std::mutex mu;
  std::condition_variable cv;
  bool ran = false;
  pool.Post([&] {
    std::lock_guard<std::mutex> lock(mu);
    ran = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return ran; }));
  EXPECT_EQ(pool.threads_for_test(), 1);
}

// A thread that waits while nothing is queued starts none: the pool grows
// only for tasks that would otherwise wait.
TEST(ThreadPoolTest, AWaitWithNothingQueuedStartsNoThread) {
  ThreadPool pool(1, "pool-test");
  std::mutex mu;
  std::condition_variable cv;
  bool ran = false;
  pool.Post([&] {
    { ThreadPool::BlockedScope blocked; }
    std::lock_guard<std::mutex> lock(mu);
    ran = true;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(
        cv.wait_for(lock, std::chrono::seconds(60), [&] { return ran; }));
  }
  EXPECT_EQ(pool.threads_for_test(), 1);
}

// The destructor runs what is queued, including tasks that wait for tasks.
TEST(ThreadPoolTest, DestroyingThePoolFinishesTheChains) {
  auto pool = std::make_unique<ThreadPool>(1, "pool-test");
  Chain chain(pool.get(), 4);
  chain.Start();
  pool.reset();
  EXPECT_TRUE(chain.WaitAll());
}

}  // namespace
}  // namespace rdmarpc::internal
