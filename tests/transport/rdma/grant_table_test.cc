#include "transport/rdma/grant_table.h"

#include <gtest/gtest.h>

namespace rdmarpc::rdma {
namespace {

TEST(GrantTableTest, IssuedGrantIsRedeemedOnceForItsCall) {
  GrantTable grants;
  IncomingPayload none;
  Grant a = grants.Issue(7, none);
  Grant b = grants.Issue(9, none);
  EXPECT_NE(a.grant_id(), 0u);
  EXPECT_NE(a.grant_id(), b.grant_id());
  EXPECT_EQ(a.call_id(), 7u);
  auto call = grants.Redeem(b.grant_id());
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(*call, 9u);
  auto again = grants.Redeem(b.grant_id());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("unknown grant"), std::string::npos);
}

TEST(GrantTableTest, ForgottenAndClearedGrantsAreUnknown) {
  GrantTable grants;
  IncomingPayload none;
  uint32_t a = grants.Issue(1, none).grant_id();
  uint32_t b = grants.Issue(2, none).grant_id();
  grants.Forget(a);
  grants.Forget(0);  // no grant: nothing happens
  EXPECT_FALSE(grants.Redeem(a).ok());
  grants.Clear();
  EXPECT_FALSE(grants.Redeem(b).ok());
  EXPECT_FALSE(grants.Redeem(0).ok());
}

}  // namespace
}  // namespace rdmarpc::rdma
