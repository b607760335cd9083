// Random identifiers the runtime hands out (client ids, server instances):
// from the OS's entropy, never 0 (0 means "none" on the wire).
//
//   uint64_t client_id = internal::RandomNonZero();
#ifndef RDMARPC_RUNTIME_RANDOM_H_
#define RDMARPC_RUNTIME_RANDOM_H_

#include <cstdint>
#include <random>

namespace rdmarpc::internal {

inline uint64_t RandomNonZero() {
  std::random_device random;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{random()} << 32) | random();
  return v;
}

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_RANDOM_H_
