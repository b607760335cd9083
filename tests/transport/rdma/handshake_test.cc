#include "transport/rdma/handshake.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "transport/rdma/connection_setup.h"

namespace rdmarpc::rdma {
namespace {

TEST(TokenTableTest, TokenRedeemsOnceForItsClient) {
  TokenTable tokens(std::chrono::seconds(30));
  auto a = tokens.Issue(11);
  auto b = tokens.Issue(22);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->size(), kTokenBytes);
  EXPECT_NE(*a, *b);
  EXPECT_EQ(tokens.Redeem(*b), std::optional<uint64_t>(22));
  EXPECT_EQ(tokens.Redeem(*b), std::nullopt);
  EXPECT_EQ(tokens.Redeem(std::string(kTokenBytes, 'x')), std::nullopt);
  EXPECT_EQ(tokens.Redeem(*a), std::optional<uint64_t>(11));
}

TEST(TokenTableTest, ExpiredAndClearedTokensAreRefused) {
  TokenTable expiring(std::chrono::nanoseconds(1));
  auto old = expiring.Issue(1);
  ASSERT_TRUE(old.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(expiring.Redeem(*old), std::nullopt);

  TokenTable tokens(std::chrono::seconds(30));
  auto t = tokens.Issue(1);
  ASSERT_TRUE(t.ok());
  tokens.Clear();
  EXPECT_EQ(tokens.Redeem(*t), std::nullopt);
}

TEST(TokenTableTest, TooManyWaitingHandshakesAreRefused) {
  TokenTable tokens(std::chrono::seconds(30));
  Status last;
  int issued = 0;
  for (int i = 0; i < 5000 && last.ok(); ++i) {
    auto t = tokens.Issue(i);
    last = t.status();
    if (t.ok()) ++issued;
  }
  EXPECT_EQ(issued, 4096);
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace rdmarpc::rdma
