// ClientContext's canceller slot, which the transports attach to and detach
// from without a lock while any thread may call TryCancel.
#include "rdmarpc/client_context.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>

#include "runtime/access.h"

namespace {

using rdmarpc::ClientContext;
using rdmarpc::internal::ClientContextAccess;

class CountingCanceller final : public rdmarpc::internal::CallCanceller {
 public:
  void Cancel() override { cancels.fetch_add(1); }
  std::atomic<int> cancels{0};
};

TEST(ClientContextTest, ACancellerAttachedBeforeTryCancelIsCancelledOnce) {
  ClientContext ctx;
  auto canceller = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, canceller));
  ctx.TryCancel();
  ctx.TryCancel();
  EXPECT_EQ(canceller->cancels.load(), 1);
  EXPECT_TRUE(ctx.IsCancelled());
  ClientContextAccess::DetachCanceller(&ctx);
}

TEST(ClientContextTest, ACancellerAttachedAfterTryCancelIsRefused) {
  ClientContext ctx;
  ctx.TryCancel();
  auto canceller = std::make_shared<CountingCanceller>();
  EXPECT_FALSE(ClientContextAccess::AttachCanceller(&ctx, canceller));
  EXPECT_EQ(canceller->cancels.load(), 0);
  // The context keeps no reference to a refused canceller.
  EXPECT_EQ(canceller.use_count(), 1);
}

TEST(ClientContextTest, ADetachedCancellerIsNotCancelled) {
  ClientContext ctx;
  auto first = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, first));
  ClientContextAccess::DetachCanceller(&ctx);
  EXPECT_EQ(first.use_count(), 1);
  // A call re-sent attaches again; the cancel reaches that one only.
  auto second = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, second));
  ctx.TryCancel();
  EXPECT_EQ(first->cancels.load(), 0);
  EXPECT_EQ(second->cancels.load(), 1);
  ClientContextAccess::DetachCanceller(&ctx);
}

// TryCancel racing a call's attach and detach (run under TSan in CI): a
// canceller the attach refused is never cancelled, one accepted is
// cancelled at most once, and once both are done the next attach is
// refused.
TEST(ClientContextTest, TryCancelRacingAttachAndDetach) {
  int accepted_and_cancelled = 0;
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    ClientContext ctx;
    auto canceller = std::make_shared<CountingCanceller>();
    std::atomic<bool> go{false};
    bool attached = false;
    std::thread call([&] {
      while (!go.load()) {
      }
      attached = ClientContextAccess::AttachCanceller(&ctx, canceller);
      if (attached) ClientContextAccess::DetachCanceller(&ctx);
    });
    std::thread cancel([&] {
      while (!go.load()) {
      }
      ctx.TryCancel();
    });
    go.store(true);
    call.join();
    cancel.join();
    EXPECT_LE(canceller->cancels.load(), 1);
    if (!attached) {
      EXPECT_EQ(canceller->cancels.load(), 0);
      ++refused;
    } else if (canceller->cancels.load() == 1) {
      ++accepted_and_cancelled;
    }
    EXPECT_FALSE(ClientContextAccess::AttachCanceller(
        &ctx, std::make_shared<CountingCanceller>()));
    EXPECT_EQ(canceller.use_count(), 1);
  }
  // Which way each round went depends on the threads' timing.
  RecordProperty("refused", refused);
  RecordProperty("accepted_and_cancelled", accepted_and_cancelled);
}

}  // namespace
