// CreditWindow on its own (label unit), then two windows driven against each
// other through a simulated connection: random traffic both ways, random
// delivery, processing and completion order. The connection must never
// deliver a frame to a side with no receive posted (that would be a
// receiver-not-ready), never post past the send queue, and never stall:
// once traffic stops, everything queued drains.
#include "transport/rdma/flow_control.h"

#include <gtest/gtest.h>

#include <deque>
#include <random>

namespace rdmarpc::rdma {
namespace {

TEST(CreditWindowTest, DataKeepsTheLastCreditForReturns) {
  CreditWindow w(
      {.peer_receives = 4, .send_queue_slots = 8, .own_receives = 4});
  EXPECT_TRUE(w.TryTakeForData());
  EXPECT_TRUE(w.TryTakeForData());
  EXPECT_TRUE(w.TryTakeForData());
  EXPECT_FALSE(w.TryTakeForData()) << "the last peer receive is reserved";
  EXPECT_FALSE(w.TryTakeForCreditReturn()) << "nothing to return yet";
  ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_TRUE(w.TryTakeForCreditReturn());
  EXPECT_EQ(w.TakeReturnable(), 1u);
  EXPECT_EQ(w.peer_credits(), 0u);
  EXPECT_FALSE(w.TryTakeForCreditReturn());
}

TEST(CreditWindowTest, SendQueueSlotsLimitEveryWorkRequest) {
  CreditWindow w(
      {.peer_receives = 10, .send_queue_slots = 2, .own_receives = 10});
  EXPECT_TRUE(w.TryTakeForData());
  EXPECT_TRUE(w.TryTakeSendSlot());
  EXPECT_FALSE(w.TryTakeForData());
  EXPECT_FALSE(w.TryTakeSendSlot());
  ASSERT_TRUE(w.OnSendCompleted().ok());
  EXPECT_TRUE(w.TryTakeSendSlot());
}

TEST(CreditWindowTest, PeerReturningMoreThanOwedIsAProtocolViolation) {
  CreditWindow w(
      {.peer_receives = 4, .send_queue_slots = 8, .own_receives = 4});
  ASSERT_TRUE(w.TryTakeForData());
  EXPECT_TRUE(w.OnPeerReturned(1).ok());
  Status s = w.OnPeerReturned(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("owed only 0"), std::string::npos) << s;
}

TEST(CreditWindowTest, AReceiverGrantsMoreCreditsWhenAskedUpToItsReceives) {
  CreditWindow sender({.peer_receives = 16,
                       .peer_first_receives = 4,
                       .send_queue_slots = 32,
                       .own_receives = 16});
  CreditWindow receiver({.peer_receives = 16,
                         .send_queue_slots = 32,
                         .own_receives = 16,
                         .own_first_receives = 4});
  EXPECT_FALSE(sender.WantsCredits());
  ASSERT_TRUE(sender.TryTakeForData());
  ASSERT_TRUE(sender.TryTakeForData());
  ASSERT_TRUE(sender.TryTakeForData());
  EXPECT_FALSE(sender.TryTakeForData()) << "4 first receives, one reserved";
  EXPECT_TRUE(sender.WantsCredits());
  // The receiver handles the three frames, then grants: its allotment
  // doubles.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(receiver.OnReceiveReposted().ok());
  EXPECT_EQ(receiver.GrantWanted(), 4u);
  receiver.Grant(4);
  EXPECT_EQ(receiver.own_allotment(), 8u);
  const uint32_t returned = receiver.TakeReturnable();
  EXPECT_EQ(returned, 7u);
  ASSERT_TRUE(sender.OnPeerReturned(returned).ok());
  EXPECT_EQ(sender.peer_allotment(), 8u);
  EXPECT_EQ(sender.peer_credits(), 8u);
  EXPECT_FALSE(sender.WantsCredits());
  // Up to the receives, never past them.
  EXPECT_EQ(receiver.GrantWanted(), 8u);
  receiver.Grant(8);
  EXPECT_EQ(receiver.GrantWanted(), 0u);
  ASSERT_TRUE(sender.OnPeerReturned(receiver.TakeReturnable()).ok());
  EXPECT_EQ(sender.peer_allotment(), 16u);
  Status past = sender.OnPeerReturned(1);
  EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition) << past;
  EXPECT_NE(past.message().find("may grant only 0 more"), std::string::npos)
      << past;
}

TEST(CreditWindowTest, ReturnsComeBackAtHalfTheAllotmentAsItStands) {
  CreditWindow w({.peer_receives = 64,
                  .send_queue_slots = 64,
                  .own_receives = 64,
                  .own_first_receives = 8});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_FALSE(w.ShouldSendCreditReturn());
  ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_TRUE(w.ShouldSendCreditReturn()) << "4 of an allotment of 8";
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_EQ(w.OnReceiveReposted().code(), absl::StatusCode::kFailedPrecondition)
      << "more frames than the peer was allotted";
}

TEST(CreditWindowTest, SettingsThatCouldStallAreRefused) {
  EXPECT_TRUE(
      CreditWindow::Validate({.peer_receives = 4, .own_receives = 4}).ok());
  EXPECT_EQ(
      CreditWindow::Validate({.peer_receives = 3, .own_receives = 8}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreditWindow::Validate({.send_queue_slots = 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreditWindow::Validate({.own_receives = 8, .return_threshold = 1}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreditWindow::Validate({.own_receives = 8, .return_threshold = 8}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreditWindow::Validate(
          {.peer_receives = 8, .peer_first_receives = 3, .own_receives = 8})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreditWindow::Validate(
          {.peer_receives = 8, .own_receives = 8, .own_first_receives = 9})
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(CreditWindowTest, BookkeepingErrorsAreReported) {
  CreditWindow w(
      {.peer_receives = 4, .send_queue_slots = 2, .own_receives = 4});
  EXPECT_EQ(w.OnSendCompleted().code(), absl::StatusCode::kInternal);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_EQ(w.OnReceiveReposted().code(), absl::StatusCode::kFailedPrecondition)
      << "a fifth frame on 4 credits";
}

TEST(CreditWindowTest, ReturnThresholdDefaultsToHalfTheReceives) {
  CreditWindow w(
      {.peer_receives = 8, .send_queue_slots = 8, .own_receives = 8});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_FALSE(w.ShouldSendCreditReturn());
  ASSERT_TRUE(w.OnReceiveReposted().ok());
  EXPECT_TRUE(w.ShouldSendCreditReturn());
}

struct Frame {
  bool credit_only;
  uint32_t credits;
  bool wants_credits;
};

struct Side {
  // Receives are posted as a shared queue would back them: the first
  // ones, then as many more as each grant.
  explicit Side(CreditWindow::Options o)
      : window(o),
        posted(o.own_first_receives == 0 ? o.own_receives
                                         : o.own_first_receives),
        sq_depth(o.send_queue_slots) {}
  CreditWindow window;
  uint32_t posted;               // our receives posted for the peer's frames
  std::deque<bool> unprocessed;  // received frames: whether they want credits
  uint32_t sq_depth;
  uint32_t in_send_queue = 0;
  int outbox = 0;  // data frames waiting for credits
  int delivered_data = 0;
  int credit_frames = 0;
};

class Simulation {
 public:
  Simulation(CreditWindow::Options a, CreditWindow::Options b, uint32_t seed)
      : sides_{Side(a), Side(b)}, rng_(seed) {}

  // One random step; false when nothing could happen.
  bool Step(bool allow_new_traffic) {
    std::vector<int> actions;
    for (int s = 0; s < 2; ++s) {
      if (allow_new_traffic) actions.push_back(s * 10 + 0);
      actions.push_back(s * 10 + 1);  // try to send
      if (!wire_[s].empty()) actions.push_back(s * 10 + 2);
      if (!sides_[s].unprocessed.empty()) actions.push_back(s * 10 + 3);
      if (sides_[s].in_send_queue > 0) actions.push_back(s * 10 + 4);
    }
    std::shuffle(actions.begin(), actions.end(), rng_);
    for (int a : actions) {
      if (Do(a / 10, a % 10)) return true;
    }
    return false;
  }

  bool Do(int s, int action) {
    Side& me = sides_[s];
    Side& peer = sides_[1 - s];
    switch (action) {
      case 0:
        me.outbox += 1;
        return true;
      case 1:
        if (me.outbox > 0 && me.window.TryTakeForData()) {
          me.outbox -= 1;
          Post(s, Frame{false, me.window.TakeReturnable(),
                        me.window.WantsCredits()});
          return true;
        }
        if (me.window.ShouldSendCreditReturn() &&
            me.window.TryTakeForCreditReturn()) {
          me.credit_frames += 1;
          Post(s, Frame{true, me.window.TakeReturnable(),
                        me.window.WantsCredits()});
          return true;
        }
        return false;
      case 2: {  // the oldest frame from s arrives at the peer
        Frame f = wire_[s].front();
        wire_[s].pop_front();
        EXPECT_GT(peer.posted, 0u) << "receiver not ready: a frame arrived "
                                      "with no receive posted";
        peer.posted -= 1;
        peer.unprocessed.push_back(f.wants_credits);
        if (!f.credit_only) peer.delivered_data += 1;
        Status st = peer.window.OnPeerReturned(f.credits);
        EXPECT_TRUE(st.ok()) << st;
        return true;
      }
      case 3: {  // s handles a received frame and re-posts its receive
        const bool wants = me.unprocessed.front();
        me.unprocessed.pop_front();
        me.posted += 1;
        Status st = me.window.OnReceiveReposted();
        EXPECT_TRUE(st.ok()) << st;
        if (wants) {
          const uint32_t granted = me.window.GrantWanted();
          me.posted += granted;  // backed before it is granted
          me.window.Grant(granted);
        }
        return true;
      }
      case 4: {
        me.in_send_queue -= 1;
        Status st = me.window.OnSendCompleted();
        EXPECT_TRUE(st.ok()) << st;
        return true;
      }
    }
    return false;
  }

  void Post(int s, Frame f) {
    Side& me = sides_[s];
    me.in_send_queue += 1;
    EXPECT_LE(me.in_send_queue, me.sq_depth) << "send queue overflow";
    wire_[s].push_back(f);
  }

  Side sides_[2];
  std::deque<Frame> wire_[2];
  std::mt19937 rng_;
};

// Runs 10000 random steps with new traffic, then steps until nothing can
// happen: no stall (every frame queued was delivered) and no credit frames
// ping-ponging. The simulation's own checks (no receiver-not-ready, no
// send queue overflow) run on every step.
void RunAndSettle(Simulation& sim) {
  int generated = 0;
  for (int i = 0; i < 20000; ++i) {
    int before = sim.sides_[0].outbox + sim.sides_[1].outbox;
    sim.Step(/*allow_new_traffic=*/i < 10000);
    if (sim.sides_[0].outbox + sim.sides_[1].outbox > before) ++generated;
    if (::testing::Test::HasFailure()) return;
  }
  // Traffic stopped: let everything settle.
  int steps = 0;
  while (sim.Step(false) && steps < 1000000) ++steps;
  EXPECT_LT(steps, 1000000) << "never settled: credit frames ping-pong";
  EXPECT_EQ(sim.sides_[0].outbox, 0) << "side 0 stalled with frames queued";
  EXPECT_EQ(sim.sides_[1].outbox, 0) << "side 1 stalled with frames queued";
  EXPECT_EQ(sim.sides_[0].delivered_data + sim.sides_[1].delivered_data,
            generated);
  EXPECT_TRUE(sim.wire_[0].empty() && sim.wire_[1].empty());
}

class FlowSimulation : public ::testing::TestWithParam<
                           std::tuple<uint32_t, uint32_t, uint32_t>> {};

TEST_P(FlowSimulation, NeverOverrunsAndAlwaysDrains) {
  auto [receives, sq, seed] = GetParam();
  CreditWindow::Options a{.peer_receives = receives,
                          .send_queue_slots = sq,
                          .own_receives = receives};
  ASSERT_TRUE(CreditWindow::Validate(a).ok());
  Simulation sim(a, a, seed);
  RunAndSettle(sim);
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlowSimulation,
                         ::testing::Combine(::testing::Values(4u, 5u, 8u, 64u),
                                            ::testing::Values(1u, 4u, 128u),
                                            ::testing::Values(1u, 2u, 3u)));

// The same with 4 first receives of `receives`, the rest granted as the
// senders ask: still no receiver-not-ready and no stall, and a busy
// sender's allotment grows.
class GrantedFlowSimulation : public ::testing::TestWithParam<
                                  std::tuple<uint32_t, uint32_t, uint32_t>> {};

TEST_P(GrantedFlowSimulation, NeverOverrunsAndAlwaysDrains) {
  auto [receives, sq, seed] = GetParam();
  CreditWindow::Options a{.peer_receives = receives,
                          .peer_first_receives = 4,
                          .send_queue_slots = sq,
                          .own_receives = receives,
                          .own_first_receives = 4};
  ASSERT_TRUE(CreditWindow::Validate(a).ok());
  Simulation sim(a, a, seed);
  RunAndSettle(sim);
  if (HasFailure()) return;
  for (int s = 0; s < 2; ++s) {
    const Side& side = sim.sides_[s];
    const Side& peer = sim.sides_[1 - s];
    EXPECT_GT(side.window.peer_allotment(), 4u) << "never granted more";
    // Settled: every receive the side backs is posted, and the peer knows
    // of no grant that is not (some may still wait to go out).
    EXPECT_EQ(side.posted, side.window.own_allotment());
    EXPECT_LE(peer.window.peer_allotment(), side.window.own_allotment());
    EXPECT_LE(side.window.own_allotment(), receives);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GrantedFlowSimulation,
                         ::testing::Combine(::testing::Values(8u, 64u),
                                            ::testing::Values(4u, 128u),
                                            ::testing::Values(1u, 2u, 3u)));

}  // namespace
}  // namespace rdmarpc::rdma
