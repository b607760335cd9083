#include "runtime/spare_block.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace rdmarpc::internal {
namespace {

// Counts live instances, so that a test sees each Give destroy its record.
struct Counted {
  static std::atomic<int> live;
  Counted() { live.fetch_add(1); }
  ~Counted() { live.fetch_sub(1); }
  int value = 0;
  std::vector<int> owned;  // heap memory of its own, freed by ~Counted
};
std::atomic<int> Counted::live{0};

TEST(SpareBlockTest, AGivenRecordsMemoryServesTheNextTake) {
  SpareBlock<Counted> spare;
  EXPECT_FALSE(spare.has_spare());
  std::unique_ptr<Counted> first = spare.Take();
  first->value = 7;
  first->owned.assign(100, 1);
  Counted* const where = first.get();
  spare.Give(std::move(first));
  EXPECT_EQ(Counted::live.load(), 0);  // destroyed at once
  EXPECT_TRUE(spare.has_spare());

  std::unique_ptr<Counted> second = spare.Take();
  EXPECT_EQ(second.get(), where);
  EXPECT_EQ(second->value, 0);  // a fresh record, not the old one
  EXPECT_TRUE(second->owned.empty());
  EXPECT_FALSE(spare.has_spare());
  EXPECT_EQ(Counted::live.load(), 1);
}

TEST(SpareBlockTest, OneBlockIsKeptAndTheRestFreed) {
  SpareBlock<Counted> spare;
  std::unique_ptr<Counted> a = spare.Take();
  std::unique_ptr<Counted> b = spare.Take();
  Counted* const kept = a.get();
  spare.Give(std::move(a));
  spare.Give(std::move(b));  // a block is kept already: freed
  spare.Give(nullptr);
  EXPECT_EQ(Counted::live.load(), 0);
  EXPECT_EQ(spare.Take().get(), kept);
}

TEST(SpareBlockTest, RecordsNeverGivenBackAreFreedByTheirOwners) {
  SpareBlock<Counted> spare;
  { std::unique_ptr<Counted> r = spare.Take(); }
  spare.Give(spare.Take());
  {
    // The spare block itself, taken and dropped: freed by unique_ptr.
    std::unique_ptr<Counted> r = spare.Take();
  }
  EXPECT_EQ(Counted::live.load(), 0);
  EXPECT_FALSE(spare.has_spare());
}

// Takers and givers on several threads never share a record (each writes
// its own mark and reads it back), and nothing leaks: run under the
// sanitizer builds.
TEST(SpareBlockTest, ThreadsRacingNeverShareARecord) {
  SpareBlock<Counted> spare;
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  std::atomic<int> shared_seen{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::unique_ptr<Counted> r = spare.Take();
        r->value = t * kRounds + i;
        std::this_thread::yield();
        if (r->value != t * kRounds + i) shared_seen.fetch_add(1);
        spare.Give(std::move(r));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(shared_seen.load(), 0);
  EXPECT_EQ(Counted::live.load(), 0);
}

}  // namespace
}  // namespace rdmarpc::internal
