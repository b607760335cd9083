#include "runtime/spin.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

namespace rdmarpc::internal {

SpinClock::SpinClock() {
#if defined(__x86_64__)
  auto t0 = std::chrono::steady_clock::now();
  uint64_t c0 = __rdtsc();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  uint64_t c1 = __rdtsc();
  auto t1 = std::chrono::steady_clock::now();
  double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
  per_us_ = us > 0 && c1 > c0 ? static_cast<double>(c1 - c0) / us : 0;
#endif
}

const SpinClock& SpinClock::Get() {
  static const SpinClock clock;
  return clock;
}

namespace {

constexpr std::chrono::microseconds kMinSpin(50);
constexpr std::chrono::microseconds kMaxSpin(2000);

struct SpinLimits {
  uint64_t fixed = 0;  // RDMARPC_RDMA_SPIN_US in ticks; 0: adaptive
  uint64_t min = 0;
  uint64_t max = 0;
};

const SpinLimits& Limits() {
  static const SpinLimits limits = [] {
    const SpinClock& clock = SpinClock::Get();
    SpinLimits l;
    l.min = clock.Ticks(kMinSpin);
    l.max = clock.Ticks(kMaxSpin);
    const char* env = std::getenv("RDMARPC_RDMA_SPIN_US");
    if (env != nullptr && *env != '\0') {
      // A fixed spin of 0 still spins one tick: 0 marks "adaptive".
      l.fixed = std::max<uint64_t>(1, clock.Ticks(std::chrono::microseconds(
                                          std::strtoul(env, nullptr, 10))));
    }
    return l;
  }();
  return limits;
}

// Moving average of round trips in ticks, weight 1/8 per sample; races
// between recorders lose a sample, which an average can afford.
std::atomic<uint64_t> average_round_trip{0};
std::atomic<uint64_t> round_trips_seen{0};
std::atomic<uint64_t> idle_gaps_seen{0};

// Not an atomic increment: this runs once per call, and recorders that
// race lose a count, which a test making one call at a time does not see.
void Count(std::atomic<uint64_t>& seen) {
  seen.store(seen.load(std::memory_order_relaxed) + 1,
             std::memory_order_relaxed);
}

void Feed(uint64_t ticks) {
  // Slower than the longest spin could not have been caught by spinning;
  // counting it would only make every spin burn the maximum.
  if (ticks > Limits().max) return;
  uint64_t avg = average_round_trip.load(std::memory_order_relaxed);
  uint64_t next = avg == 0 ? ticks : avg - avg / 8 + ticks / 8;
  average_round_trip.store(next, std::memory_order_relaxed);
}

}  // namespace

std::atomic<uint64_t> spin_for_testing{0};

uint64_t SpinTicks() {
  if (uint64_t t = spin_for_testing.load(std::memory_order_relaxed)) return t;
  const SpinLimits& l = Limits();
  if (l.fixed != 0) return l.fixed;
  uint64_t twice = 2 * average_round_trip.load(std::memory_order_relaxed);
  return std::clamp(twice, l.min, l.max);
}

void SetSpinForTesting(std::chrono::microseconds spin) {
  spin_for_testing.store(spin.count() == 0 ? 0 : SpinClock::Get().Ticks(spin),
                         std::memory_order_relaxed);
}

uint64_t RoundTripsSeenForTesting() {
  return round_trips_seen.load(std::memory_order_relaxed);
}

uint64_t IdleGapsSeenForTesting() {
  return idle_gaps_seen.load(std::memory_order_relaxed);
}

void RecordRoundTrip(uint64_t ticks) {
  Count(round_trips_seen);
  Feed(ticks);
}

void RecordIdleGap(uint64_t ticks) {
  Count(idle_gaps_seen);
  Feed(ticks);
}

}  // namespace rdmarpc::internal
