#include "transport/rdma/landing_pool.h"

#include <gtest/gtest.h>

#include <memory>
#include <utility>

namespace rdmarpc::rdma {
namespace {

TEST(LandingPoolTest, ReservationsUpToCapacityThenExhaustedNamingTheUse) {
  auto pool = std::make_shared<LandingPool>(100);
  auto a = pool->Reserve(60);
  ASSERT_TRUE(a.ok());
  auto b = pool->Reserve(50);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("60 of 100 bytes granted"),
            std::string::npos)
      << b.status();
  // The refused reservation took nothing.
  EXPECT_TRUE(pool->Reserve(40).ok());
}

TEST(LandingPoolTest, BytesReturnWhenTheReservationGoes) {
  auto pool = std::make_shared<LandingPool>(100);
  {
    auto a = pool->Reserve(100);
    ASSERT_TRUE(a.ok());
    EXPECT_FALSE(pool->Reserve(1).ok());
    LandingReservation moved = *std::move(a);
    EXPECT_FALSE(pool->Reserve(1).ok());  // moving keeps them held
  }
  EXPECT_TRUE(pool->Reserve(100).ok());
}

}  // namespace
}  // namespace rdmarpc::rdma
