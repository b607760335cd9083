// The spins' two averages: round trips set a blocking caller's spin and
// an engine's; a server's idle gaps only an engine's, and gaps no spin
// could bridge pull it back to the floor.
#include "runtime/spin.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>

#include "gtest/gtest.h"

namespace rdmarpc::internal {
namespace {

using std::chrono::microseconds;

uint64_t Ticks(int64_t us) { return SpinClock::Get().Ticks(microseconds(us)); }

// Enough samples that the average (weight 1/8 each) forgets what came
// before to within 1e-3.
void RoundTrips(int64_t us) {
  for (int i = 0; i < 64; ++i) RecordRoundTrip(Ticks(us));
}
void IdleGaps(int64_t us) {
  for (int i = 0; i < 64; ++i) RecordIdleGap(Ticks(us));
}

// Within 5% (or 20 ticks of a microsecond clock): the integer average
// settles a few ticks from its target.
void ExpectSpin(uint64_t got, int64_t us) {
  const double want = static_cast<double>(Ticks(us));
  EXPECT_NEAR(static_cast<double>(got), want, std::max(0.05 * want, 20.0))
      << "expected about " << us << " us";
}

TEST(Spin, IdleGapsLengthenOnlyTheEnginesSpinAndFadeWhenTooLong) {
  const char* fixed = std::getenv("RDMARPC_RDMA_SPIN_US");
  if (fixed != nullptr && *fixed != '\0') {
    GTEST_SKIP() << "RDMARPC_RDMA_SPIN_US fixes the spin";
  }
  RoundTrips(100);
  IdleGaps(30);
  ExpectSpin(SpinTicks(), 200);
  ExpectSpin(EngineSpinTicks(), 200);  // the longer average sets it
  IdleGaps(400);
  ExpectSpin(SpinTicks(), 200);  // callers wait for round trips only
  ExpectSpin(EngineSpinTicks(), 800);
  // Clients that slowed past the ceiling: the engine's spin falls back.
  IdleGaps(5000);
  ExpectSpin(EngineSpinTicks(), 200);
  RoundTrips(10);
  EXPECT_EQ(EngineSpinTicks(), Ticks(50));  // the floor
  // A round trip too slow to spin for is left out instead: the caller
  // still spins for the calls that come back in time.
  RoundTrips(300);
  RoundTrips(5000);
  ExpectSpin(SpinTicks(), 600);
  ExpectSpin(EngineSpinTicks(), 600);
  // Never past the ceiling.
  IdleGaps(1900);
  ExpectSpin(EngineSpinTicks(), 2000);
}

TEST(Spin, ATestSpinOverridesBoth) {
  SetSpinForTesting(microseconds(70));
  EXPECT_EQ(SpinTicks(), Ticks(70));
  EXPECT_EQ(EngineSpinTicks(), Ticks(70));
  SetSpinForTesting(microseconds(0));
}

}  // namespace
}  // namespace rdmarpc::internal
