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
  void Cancel(uint64_t call_id) override {
    last_call_id.store(call_id);
    cancels.fetch_add(1);
  }
  std::atomic<int> cancels{0};
  std::atomic<uint64_t> last_call_id{0};
};

TEST(ClientContextTest, ACancellerAttachedBeforeTryCancelIsCancelledOnce) {
  ClientContext ctx;
  auto canceller = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, canceller, 7));
  ctx.TryCancel();
  ctx.TryCancel();
  EXPECT_EQ(canceller->cancels.load(), 1);
  EXPECT_EQ(canceller->last_call_id.load(), 7u);
  EXPECT_TRUE(ctx.IsCancelled());
  ClientContextAccess::DetachCanceller(&ctx);
}

TEST(ClientContextTest, ACancellerAttachedAfterTryCancelIsRefused) {
  ClientContext ctx;
  ctx.TryCancel();
  auto canceller = std::make_shared<CountingCanceller>();
  EXPECT_FALSE(ClientContextAccess::AttachCanceller(&ctx, canceller, 1));
  EXPECT_EQ(canceller->cancels.load(), 0);
  // The context keeps no reference to a refused canceller.
  EXPECT_EQ(canceller.use_count(), 1);
}

TEST(ClientContextTest, ADetachedCancellerIsNotCancelled) {
  ClientContext ctx;
  auto first = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, first, 1));
  ClientContextAccess::DetachCanceller(&ctx);
  EXPECT_EQ(first.use_count(), 1);
  // A call re-sent attaches again; the cancel reaches that one only.
  auto second = std::make_shared<CountingCanceller>();
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&ctx, second, 2));
  ctx.TryCancel();
  EXPECT_EQ(first->cancels.load(), 0);
  EXPECT_EQ(second->cancels.load(), 1);
  EXPECT_EQ(second->last_call_id.load(), 2u);
  ClientContextAccess::DetachCanceller(&ctx);
}

// One canceller may serve many calls (an RDMA connection's): each cancel
// names the call its context had attached.
TEST(ClientContextTest, ASharedCancellerIsToldWhichCall) {
  auto shared = std::make_shared<CountingCanceller>();
  ClientContext finished, running;
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&finished, shared, 11));
  ASSERT_TRUE(ClientContextAccess::AttachCanceller(&running, shared, 12));
  ClientContextAccess::DetachCanceller(&finished);
  finished.TryCancel();
  EXPECT_EQ(shared->cancels.load(), 0);
  running.TryCancel();
  EXPECT_EQ(shared->cancels.load(), 1);
  EXPECT_EQ(shared->last_call_id.load(), 12u);
  ClientContextAccess::DetachCanceller(&running);
  EXPECT_EQ(shared.use_count(), 1);
}

// TryCancel racing a call's attach and detach, round after round on two
// long-lived threads released together: a stress test for the sanitizer
// builds (a race on the canceller slot is a TSan report), with what must
// hold whichever way a round went: a canceller the attach refused is never
// cancelled, one accepted is cancelled at most once, the context holds
// none once both are done, and the next attach is refused.
TEST(ClientContextTest, TryCancelRacingAttachAndDetach) {
  constexpr int kRounds = 10000;
  struct Round {
    ClientContext ctx;
    std::shared_ptr<CountingCanceller> canceller =
        std::make_shared<CountingCanceller>();
    bool attached = false;
  };
  std::unique_ptr<Round> current;
  std::atomic<int> go{-1};  // the round the threads may run
  std::atomic<int> done{0};
  auto wait_for = [](const std::atomic<int>& value, int want) {
    while (value.load() != want) std::this_thread::yield();
  };
  std::thread call([&] {
    for (int r = 0; r < kRounds; ++r) {
      wait_for(go, r);
      Round& x = *current;
      x.attached =
          ClientContextAccess::AttachCanceller(&x.ctx, x.canceller, r + 1);
      if (x.attached) ClientContextAccess::DetachCanceller(&x.ctx);
      done.fetch_add(1);
    }
  });
  std::thread cancel([&] {
    for (int r = 0; r < kRounds; ++r) {
      wait_for(go, r);
      current->ctx.TryCancel();
      done.fetch_add(1);
    }
  });
  for (int r = 0; r < kRounds; ++r) {
    current = std::make_unique<Round>();
    done.store(0);
    go.store(r);
    wait_for(done, 2);
    Round& x = *current;
    const int cancels = x.canceller->cancels.load();
    ASSERT_LE(cancels, 1) << "round " << r;
    if (!x.attached) {
      ASSERT_EQ(cancels, 0) << "round " << r;
    } else if (cancels == 1) {
      ASSERT_EQ(x.canceller->last_call_id.load(), uint64_t(r + 1))
          << "round " << r;
    }
    ASSERT_EQ(x.canceller.use_count(), 1) << "round " << r;
    ASSERT_FALSE(ClientContextAccess::AttachCanceller(
        &x.ctx, std::make_shared<CountingCanceller>(), r + 1))
        << "round " << r;
  }
  call.join();
  cancel.join();
}

}  // namespace
