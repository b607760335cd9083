#include "transport/rdma/send_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace rdmarpc::rdma {
namespace {

// Every index the stack gives, sorted; at most one more than it can hold
// (a stack whose links formed a cycle would give indices for ever).
std::vector<int> PopAll(FreeIndexStack& stack) {
  std::vector<int> popped;
  for (int i = stack.Pop(); i >= 0 && popped.size() <= stack.capacity();
       i = stack.Pop()) {
    popped.push_back(i);
  }
  std::sort(popped.begin(), popped.end());
  return popped;
}

TEST(FreeIndexStackTest, HoldsEveryIndexOnceThenIsEmpty) {
  FreeIndexStack stack(5);
  EXPECT_EQ(stack.size(), 5u);
  EXPECT_EQ(PopAll(stack), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(stack.size(), 0u);
  EXPECT_EQ(stack.Pop(), -1);
  stack.Push(3);
  stack.Push(1);
  EXPECT_EQ(stack.size(), 2u);
  EXPECT_EQ(stack.Pop(), 1);  // last in, first out
  EXPECT_EQ(stack.Pop(), 3);
  EXPECT_EQ(stack.Pop(), -1);
}

TEST(FreeIndexStackTest, EmptyStackHasNothing) {
  FreeIndexStack stack(0);
  EXPECT_EQ(stack.Pop(), -1);
}

// Threads take and give back indices of a stack smaller than their number,
// so they race on an empty stack and on the same top: an index is never
// held by two at once, and every one is back at the end.
TEST(FreeIndexStackTest, RacingTakersNeverShareAnIndex) {
  constexpr uint32_t kIndices = 3;
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  FreeIndexStack stack(kIndices);
  std::vector<std::atomic<int>> holders(kIndices);
  std::atomic<int> shared{0};
  std::atomic<int> taken{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int round = 0; round < kRounds; ++round) {
        const int index = stack.Pop();
        if (index < 0) continue;
        taken.fetch_add(1);
        if (holders[index].exchange(t + 1) != 0) shared.fetch_add(1);
        // Held a while, so that another taker of the same index would
        // find it held.
        std::this_thread::yield();
        if (holders[index].exchange(0) != t + 1) shared.fetch_add(1);
        stack.Push(index);
      }
    });
  }
  go.store(true);
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(shared.load(), 0);
  EXPECT_GT(taken.load(), 0);
  EXPECT_EQ(stack.size(), kIndices);
  EXPECT_EQ(PopAll(stack), (std::vector<int>{0, 1, 2}));
}

}  // namespace
}  // namespace rdmarpc::rdma
