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

std::atomic<uint64_t> spin_for_testing{0};  // ticks; 0: none set

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

// A moving average in ticks, weight 1/8 per sample; races between
// recorders lose a sample, which an average can afford.
struct Average {
  std::atomic<uint64_t> ticks{0};
  // The first sample sets the average (0 is a sample too: an idle gap
  // too long to spin across).
  std::atomic<bool> seeded{false};
  std::atomic<uint64_t> seen{0};  // samples given, for tests

  void Feed(uint64_t sample) {
    uint64_t next = sample;
    if (seeded.load(std::memory_order_relaxed)) {
      uint64_t avg = ticks.load(std::memory_order_relaxed);
      next = avg - avg / 8 + sample / 8;
    } else {
      seeded.store(true, std::memory_order_relaxed);
    }
    ticks.store(next, std::memory_order_relaxed);
  }
  // Not an atomic increment: this runs once per call, and recorders that
  // race lose a count, which a test making one call at a time does not
  // see.
  void Count() {
    seen.store(seen.load(std::memory_order_relaxed) + 1,
               std::memory_order_relaxed);
  }
};

Average round_trips;
Average idle_gaps;

// Twice `average`, within the limits; or the fixed spin.
uint64_t SpinFor(uint64_t average) {
  if (uint64_t t = spin_for_testing.load(std::memory_order_relaxed)) return t;
  const SpinLimits& l = Limits();
  if (l.fixed != 0) return l.fixed;
  return std::clamp(2 * average, l.min, l.max);
}

}  // namespace

uint64_t SpinTicks() {
  return SpinFor(round_trips.ticks.load(std::memory_order_relaxed));
}

uint64_t EngineSpinTicks() {
  return SpinFor(std::max(round_trips.ticks.load(std::memory_order_relaxed),
                          idle_gaps.ticks.load(std::memory_order_relaxed)));
}

void SetSpinForTesting(std::chrono::microseconds spin) {
  spin_for_testing.store(spin.count() == 0 ? 0 : SpinClock::Get().Ticks(spin),
                         std::memory_order_relaxed);
}

uint64_t RoundTripsSeenForTesting() {
  return round_trips.seen.load(std::memory_order_relaxed);
}

uint64_t IdleGapsSeenForTesting() {
  return idle_gaps.seen.load(std::memory_order_relaxed);
}

void RecordRoundTrip(uint64_t ticks) {
  round_trips.Count();
  // A call slower than the longest spin could not have been caught by
  // spinning; counting it would only make every spin burn the maximum.
  if (ticks <= Limits().max) round_trips.Feed(ticks);
}

void RecordIdleGap(uint64_t ticks) {
  idle_gaps.Count();
  // A gap no spin could bridge counts as none: when the clients slow down,
  // the engine's spin falls back to the callers' (the floor in a process
  // that makes no calls) instead of keeping the length their faster calls
  // taught it.
  idle_gaps.Feed(ticks <= Limits().max ? ticks : 0);
}

}  // namespace rdmarpc::internal
