// The server's budget of landing memory: how many bytes it grants to
// requests at once, over all connections. A request that would exceed it is
// answered `not_executed`, and the client carries it over gRPC instead.
//
//   auto pool = std::make_shared<LandingPool>(8ull << 30);
//   StatusOr<LandingReservation> held = pool->Reserve(bytes);
//   if (!held.ok()) refuse the request with held.status();
//   // the bytes return to the pool when `held` is destroyed
//
// Thread-safe.
#ifndef RDMARPC_TRANSPORT_RDMA_LANDING_POOL_H_
#define RDMARPC_TRANSPORT_RDMA_LANDING_POOL_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "rdmarpc/status.h"

namespace rdmarpc::rdma {

class LandingPool;

// Bytes held against a LandingPool until destroyed (or moved from).
class LandingReservation {
 public:
  LandingReservation() = default;
  LandingReservation(LandingReservation&& o) noexcept;
  LandingReservation& operator=(LandingReservation&& o) noexcept;
  ~LandingReservation() { Release(); }

 private:
  friend class LandingPool;
  LandingReservation(std::shared_ptr<LandingPool> pool, uint64_t bytes)
      : pool_(std::move(pool)), bytes_(bytes) {}
  void Release();

  std::shared_ptr<LandingPool> pool_;
  uint64_t bytes_ = 0;
};

class LandingPool : public std::enable_shared_from_this<LandingPool> {
 public:
  explicit LandingPool(uint64_t capacity) : capacity_(capacity) {}

  // `bytes` more, or RESOURCE_EXHAUSTED saying how much is in use. Fault
  // point rdma.server.landing_pool_exhausted refuses one reservation.
  [[nodiscard]] StatusOr<LandingReservation> Reserve(uint64_t bytes);

 private:
  friend class LandingReservation;
  const uint64_t capacity_;
  std::atomic<uint64_t> in_use_{0};
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_LANDING_POOL_H_
