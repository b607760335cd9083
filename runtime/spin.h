// Bounded busy-waits that make no system call: the RDMA engine spins for
// EngineSpinTicks() after its last completion before it sleeps, and a
// blocking call over RDMA spins SpinTicks() for its response before it
// sleeps.
//
//   const SpinClock& clock = SpinClock::Get();
//   uint64_t until = clock.Now() + SpinTicks();
//   while (!ready() && clock.Now() < until) CpuRelax();
//   // The RDMA client, as each response comes:
//   RecordRoundTrip(clock.Now() - posted);
//   // The RDMA server, as a request comes to a connection with no call:
//   RecordIdleGap(clock.Now() - went_idle);
//
// A caller's spin follows the round trips the process sees: twice their
// moving average, at least 50 us and at most 2 ms, so a call answered
// within about one round trip is caught spinning whether the wire takes
// 3 us (a NIC) or 300 us (soft-RoCE under emulation): every RDMA call's
// round trip is a sample, whichever API made it. An engine spins twice the
// longer of that average and the average idle gap of the server
// connections (from a connection's last call ending to its next request),
// so a process that only serves catches a client calling back to back. A
// gap over 2 ms counts as 0: when the clients slow down, the engine's spin
// falls back within a few dozen calls to the caller's (twice the round
// trips; the floor in a process that makes no calls). A client calling with
// gaps under 2 ms keeps its server's engine spinning between calls, as a
// blocking caller spins through its round trip. RDMARPC_RDMA_SPIN_US fixes
// both spins instead.
//
// The clock is the CPU's cycle counter on x86-64 (calibrated once against
// steady_clock, 5 ms on first use): in a VM whose clock source is hpet
// every steady_clock read is a system call. Elsewhere it is steady_clock.
#ifndef RDMARPC_RUNTIME_SPIN_H_
#define RDMARPC_RUNTIME_SPIN_H_

#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace rdmarpc::internal {

class SpinClock {
 public:
  static const SpinClock& Get();

  // Ticks since an arbitrary start.
  uint64_t Now() const {
#if defined(__x86_64__)
    if (per_us_ > 0) return __rdtsc();
#endif
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
  uint64_t Ticks(std::chrono::microseconds d) const {
    double per_us = per_us_ > 0 ? per_us_ : 1.0;
    return static_cast<uint64_t>(static_cast<double>(d.count()) * per_us);
  }

 private:
  SpinClock();
  double per_us_ = 0;  // 0: Now() counts microseconds of steady_clock
};

// How long a blocking caller spins for its response before it sleeps, in
// SpinClock ticks.
uint64_t SpinTicks();
// How long an engine spins after its last completion before it sleeps.
uint64_t EngineSpinTicks();
// Tests: spins last `spin` from now on (0: back to the configured spin),
// so that what a spin catches does not depend on the machine's speed.
void SetSpinForTesting(std::chrono::microseconds spin);

// Feeds the round-trip average (behind SpinTicks(), and EngineSpinTicks()
// when it is the longer) with one RDMA round trip: SpinClock ticks from
// posting a request to seeing its response, whatever API made the call.
// One over 2 ms is left out, so a process whose own calls all turn slower
// than that keeps the spin its faster calls taught it.
void RecordRoundTrip(uint64_t ticks);
// Feeds the engines' second average with the idle gap of a server's
// connection: from the end of its last call in flight to its next request
// (the response's trip, the client's own work and the next request's
// trip). It is how a process that only serves learns its clients' pace.
// Measured only across idle, so pipelined calls add no samples.
void RecordIdleGap(uint64_t ticks);
// Tests: how many samples RecordRoundTrip and RecordIdleGap were given,
// counting round trips left out of the average (races between recorders
// may lose one).
uint64_t RoundTripsSeenForTesting();
uint64_t IdleGapsSeenForTesting();

// Eases a spin on the sibling hyper-thread.
inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_SPIN_H_
