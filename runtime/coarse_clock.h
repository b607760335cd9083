// Clock reads for bookkeeping that needs milliseconds, not nanoseconds
// (silence checks, re-send ages, the call log's horizons).
//
//   auto start = internal::CoarseSteadyNow();  // a std::chrono::steady_clock
//                                              // time point, ~4 ms steps
//
// CLOCK_MONOTONIC_COARSE is answered from the vDSO whatever the clock
// source, so it never enters the kernel; steady_clock::now() becomes a
// system call where the clock source is one the vDSO cannot read (a VM's
// hpet), and the datapath reads clocks on every call.
#ifndef RDMARPC_RUNTIME_COARSE_CLOCK_H_
#define RDMARPC_RUNTIME_COARSE_CLOCK_H_

#include <time.h>

#include <chrono>

namespace rdmarpc::internal {

// The same epoch as std::chrono::steady_clock (CLOCK_MONOTONIC), so the two
// compare; it may lag steady_clock by one tick of the kernel's timer.
inline std::chrono::steady_clock::time_point CoarseSteadyNow() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::seconds(ts.tv_sec) +
          std::chrono::nanoseconds(ts.tv_nsec)));
}

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_COARSE_CLOCK_H_
