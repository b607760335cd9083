#include "transport/rdma/landing_arena.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

bool AllZero(const TensorBuffer& b) {
  const auto* p = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < b.size(); ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

TEST(LandingArenaTest, GrowsBySegmentsThatAtLeastDoubleItUpToItsLimit) {
  auto arena = LandingArena::CreateForTesting(kMiB, 8 * kMiB,
                                              /*clear_large_aside=*/false);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->segments(), 1);
  EXPECT_EQ(arena->mapped_bytes(), kMiB);
  std::optional<TensorBuffer> first = arena->Allocate(kMiB);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(arena->SegmentOf(first->data()), 0);
  // No room left in the first segment: a second one of the arena's size.
  std::optional<TensorBuffer> second = arena->Allocate(100);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(arena->segments(), 2);
  EXPECT_EQ(arena->SegmentOf(second->data()), 1);
  EXPECT_EQ(arena->mapped_bytes(), 2 * kMiB);
  // A block larger than the arena so far gets a segment of its own size.
  std::optional<TensorBuffer> large = arena->Allocate(3 * kMiB + 1);
  ASSERT_TRUE(large.has_value());
  EXPECT_EQ(arena->SegmentOf(large->data()), 2);
  EXPECT_EQ(arena->mapped_bytes(), 2 * kMiB + 3 * kMiB + 4096);
  // The limit leaves room for no other segment that fits 3 MiB.
  EXPECT_FALSE(arena->Allocate(3 * kMiB).has_value());
  EXPECT_EQ(arena->segments(), 3);
  // Once blocks return, their room serves again without growing.
  first.reset();
  std::optional<TensorBuffer> again = arena->Allocate(kMiB);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(arena->SegmentOf(again->data()), 0);
  EXPECT_EQ(arena->segments(), 3);
  int outside = 0;
  EXPECT_EQ(arena->SegmentOf(&outside), -1);
}

TEST(LandingArenaTest, AReturnedBlockReadsAsZeroForTheNextCall) {
  auto arena = LandingArena::CreateForTesting(kMiB, kMiB,
                                              /*clear_large_aside=*/false);
  ASSERT_NE(arena, nullptr);
  const void* at = nullptr;
  {
    std::optional<TensorBuffer> block = arena->Allocate(4096);
    ASSERT_TRUE(block.has_value());
    EXPECT_TRUE(AllZero(*block));
    std::memset(block->data(), 0xab, block->size());
    at = block->data();
  }
  std::optional<TensorBuffer> next = arena->Allocate(4096);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->data(), at);  // first fit: the same memory
  EXPECT_TRUE(AllZero(*next));
}

// A large block is cleared on the registration thread, not by whoever
// dropped it (a poller, for one): its room comes back only once that
// thread got to it.
TEST(LandingArenaTest, ALargeBlockIsClearedAsideBeforeItsRoomReturns) {
  auto arena = LandingArena::CreateForTesting(4 * kMiB, 4 * kMiB,
                                              /*clear_large_aside=*/true);
  ASSERT_NE(arena, nullptr);
  std::promise<void> release;
  std::promise<void> holding;
  RunAside([&holding, wait = release.get_future().share()] {
    holding.set_value();
    wait.wait();
  });
  holding.get_future().wait();
  {
    std::optional<TensorBuffer> block = arena->Allocate(4 * kMiB);
    ASSERT_TRUE(block.has_value());
    std::memset(block->data(), 0xcd, block->size());
  }
  // The registration thread is held: the block is not back yet.
  EXPECT_FALSE(arena->Allocate(4 * kMiB).has_value());
  release.set_value();
  std::optional<TensorBuffer> next;
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!(next = arena->Allocate(4 * kMiB)) &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(next.has_value());
  EXPECT_TRUE(AllZero(*next));
  // Its clear is queued too; the arena must outlive it.
  next.reset();
  std::promise<void> drained;
  RunAside([&drained] { drained.set_value(); });
  drained.get_future().wait();
}

}  // namespace
}  // namespace rdmarpc::rdma
