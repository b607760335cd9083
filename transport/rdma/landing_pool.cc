#include "transport/rdma/landing_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"

namespace rdmarpc::rdma {

LandingReservation::LandingReservation(LandingReservation&& o) noexcept
    : pool_(std::move(o.pool_)), bytes_(std::exchange(o.bytes_, 0)) {}

LandingReservation& LandingReservation::operator=(
    LandingReservation&& o) noexcept {
  Release();
  pool_ = std::move(o.pool_);
  bytes_ = std::exchange(o.bytes_, 0);
  return *this;
}

void LandingReservation::Release() {
  if (pool_ && bytes_ > 0) pool_->in_use_.fetch_sub(bytes_);
  bytes_ = 0;
}

StatusOr<LandingReservation> LandingPool::Reserve(uint64_t bytes) {
  const uint64_t before = in_use_.fetch_add(bytes);
  LandingReservation held(shared_from_this(), bytes);
  if (before + bytes > capacity_ ||
      RDMARPC_FAULT("rdma.server.landing_pool_exhausted")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server's RDMA landing pool is exhausted (", before, " of ",
        capacity_, " bytes granted; this request needs ", bytes, ")"));
  }
  return held;
}

}  // namespace rdmarpc::rdma
