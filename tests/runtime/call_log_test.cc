// CallLog, the server's record that keeps re-sent calls exactly-once:
// first arrivals run, repeats wait for or reuse the outcome, and nothing
// waits forever (settle timeout, Close, expiry past a stuck record). The
// clock is fake, so every step is an event the test controls.
#include "runtime/call_log.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime_test.pb.h"

namespace rdmarpc::internal {
namespace {

using namespace std::chrono_literals;
using Clock = CallLog::Clock;

constexpr uint64_t kInstance = 77;
constexpr uint64_t kClient = 5;

// One completion's outcome; `runs` counts how often it ran.
struct Outcome {
  int runs = 0;
  std::optional<Status> status;
  std::shared_ptr<google::protobuf::Message> response;
};

class CallLogTest : public ::testing::Test {
 protected:
  CallLogTest() {
    method_.descriptor.path = "/test.Svc/Run";
    method_.descriptor.request_prototype =
        &rdmarpc_runtime_test::Outer::default_instance();
    method_.descriptor.response_prototype =
        &rdmarpc_runtime_test::Outer::default_instance();
  }

  CallLog::Options Options() {
    CallLog::Options o;
    o.window = 30s;
    o.settle_timeout = 10s;
    o.now = [this] { return now_; };
    return o;
  }

  // A call as a transport hands it to the log; `resent` marks a re-send,
  // sent 1 ms after the call, whose first message arrives now.
  std::shared_ptr<ServerCallState> Call(uint64_t call_id, bool resent = false,
                                        uint64_t instance = kInstance) {
    auto state =
        std::make_shared<ServerCallState>(&method_, TransportKind::kGrpc);
    state->client_id = kClient;
    state->call_id = call_id;
    state->logged = true;
    if (resent) state->resend = ServerCallState::Resend{instance, 1ms, now_};
    return state;
  }

  // Admits `state`; a repeat's completion records into `out`.
  static bool Admit(CallLog& log, const std::shared_ptr<ServerCallState>& state,
                    Outcome* out) {
    Dispatcher::Completion done =
        [out](Status s, std::shared_ptr<google::protobuf::Message> r) {
          ++out->runs;
          out->status = std::move(s);
          out->response = std::move(r);
        };
    return log.Admit(state, done);
  }

  // The handler of `state` returned OK with no response, which reached
  // the client.
  static void Deliver(CallLog& log, const ServerCallState& state) {
    log.Finished(state, absl::OkStatus(), nullptr);
    log.Delivered(state);
  }

  static std::unique_ptr<google::protobuf::Message> Response(
      const std::string& label) {
    auto r = std::make_unique<rdmarpc_runtime_test::Outer>();
    (*r->mutable_labels())["v"] = label;
    return r;
  }

  static std::string LabelOf(const Outcome& o) {
    auto* r =
        dynamic_cast<const rdmarpc_runtime_test::Outer*>(o.response.get());
    return r == nullptr ? "" : r->labels().at("v");
  }

  ServerMethod method_;
  Clock::time_point now_ = Clock::time_point() + 1000h;
};

TEST_F(CallLogTest, RepeatOfARunningCallWaitsForItsOutcome) {
  CallLog log(Options(), kInstance);
  auto first = Call(1);
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  auto again = Call(1, /*resent=*/true);
  EXPECT_FALSE(Admit(log, again, &repeat));
  EXPECT_EQ(repeat.runs, 0);
  auto response = Response("ran");
  first->initial_metadata.emplace("x-first", "1");
  log.Finished(*first, absl::OkStatus(), response.get());
  EXPECT_EQ(repeat.runs, 1);
  ASSERT_TRUE(repeat.status && repeat.status->ok()) << *repeat.status;
  EXPECT_EQ(LabelOf(repeat), "ran");
  // The repeat answers with the first run's metadata too.
  EXPECT_EQ(again->initial_metadata, first->initial_metadata);
  log.Delivered(*first);
  EXPECT_EQ(repeat.runs, 1);
  EXPECT_EQ(unused.runs, 0);
  EXPECT_EQ(log.stats().repeats_answered, 1u);
}

TEST_F(CallLogTest, RepeatOfAnUndeliveredCallGetsTheKeptResponse) {
  CallLog log(Options(), kInstance);
  auto first = Call(2);
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  auto response = Response("kept");
  first->trailing_metadata.emplace("x-kept", "yes");
  log.Finished(*first, absl::OkStatus(), response.get());
  log.Undelivered(first, absl::OkStatus(), std::move(response));
  auto again = Call(2, true);
  EXPECT_FALSE(Admit(log, again, &repeat));
  EXPECT_EQ(repeat.runs, 1);
  ASSERT_TRUE(repeat.status->ok()) << *repeat.status;
  EXPECT_EQ(LabelOf(repeat), "kept");
  EXPECT_EQ(again->trailing_metadata, first->trailing_metadata);
}

// The connection a response goes out on, as the log sees it: a re-send
// while the response is on its way abandons it.
class FakePath final : public ResponsePath {
 public:
  void Abandon(const Status& why) override {
    ++abandoned;
    reason = std::string(why.message());
  }
  int abandoned = 0;
  std::string reason;
};

TEST_F(CallLogTest, RepeatOfACallBeingSentAbandonsItsConnection) {
  CallLog log(Options(), kInstance);
  auto path = std::make_shared<FakePath>();
  auto first = Call(3);
  first->response_path = path;
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  // A repeat while the handler runs waits for it: nothing to abandon yet.
  Outcome early;
  EXPECT_FALSE(Admit(log, Call(3, true), &early));
  EXPECT_EQ(path->abandoned, 0);
  auto response = Response("sending");
  log.Finished(*first, absl::OkStatus(), response.get());
  EXPECT_EQ(early.runs, 1);
  // Being sent: the repeat waits and makes the transport give the send up,
  // which reports the response undelivered and so answers the repeat.
  EXPECT_FALSE(Admit(log, Call(3, true), &repeat));
  EXPECT_EQ(path->abandoned, 1);
  EXPECT_NE(path->reason.find("re-sent call 3"), std::string::npos)
      << path->reason;
  EXPECT_EQ(repeat.runs, 0);
  log.Undelivered(first, absl::OkStatus(), std::move(response));
  EXPECT_EQ(repeat.runs, 1);
  ASSERT_TRUE(repeat.status->ok()) << *repeat.status;
  EXPECT_EQ(LabelOf(repeat), "sending");
  // Settled: a later repeat is answered from the record, abandoning nothing.
  Outcome later;
  EXPECT_FALSE(Admit(log, Call(3, true), &later));
  EXPECT_EQ(later.runs, 1);
  EXPECT_EQ(path->abandoned, 1);
  EXPECT_EQ(unused.runs, 0);
}

TEST_F(CallLogTest, RepeatOfADeliveredCallIsRefusedNotRun) {
  CallLog log(Options(), kInstance);
  auto first = Call(3);
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  Deliver(log, *first);
  EXPECT_FALSE(Admit(log, Call(3, true), &repeat));
  EXPECT_EQ(repeat.runs, 1);
  EXPECT_EQ(repeat.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(repeat.status->message().find("already ran"), std::string::npos);
}

TEST_F(CallLogTest, RepeatNeverWaitsOnAResponseWhoseFateIsNotReported) {
  CallLog log(Options(), kInstance);
  auto first = Call(4);
  Outcome unused, waiting, later;
  ASSERT_TRUE(Admit(log, first, &unused));
  auto response = Response("lost");
  // The handler finished; the transport never says whether the response
  // reached the client.
  log.Finished(*first, absl::OkStatus(), response.get());
  EXPECT_FALSE(Admit(log, Call(4, true), &waiting));
  now_ += 9s;
  log.Sweep();
  EXPECT_EQ(waiting.runs, 0) << "inside settle_timeout it still waits";
  now_ += 2s;
  log.Sweep();
  ASSERT_EQ(waiting.runs, 1);
  EXPECT_EQ(waiting.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(waiting.status->message().find("may have run"), std::string::npos)
      << *waiting.status;
  // A later repeat is answered at once.
  EXPECT_FALSE(Admit(log, Call(4, true), &later));
  EXPECT_EQ(later.runs, 1);
  EXPECT_EQ(later.status->code(), absl::StatusCode::kUnavailable);
  // The transport reporting late changes nothing for the answered ones.
  log.Delivered(*first);
  EXPECT_EQ(waiting.runs, 1);
  EXPECT_EQ(later.runs, 1);
}

TEST_F(CallLogTest, CloseAnswersWaitingRepeatsAndRefusesLaterOnes) {
  CallLog log(Options(), kInstance);
  auto running = Call(5);
  Outcome unused, waiting, after, unknown;
  ASSERT_TRUE(Admit(log, running, &unused));
  EXPECT_FALSE(Admit(log, Call(5, true), &waiting));
  log.Close();
  ASSERT_EQ(waiting.runs, 1);
  EXPECT_EQ(waiting.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(waiting.status->message().find("shutting down"), std::string::npos);
  EXPECT_FALSE(Admit(log, Call(5, true), &after));
  EXPECT_EQ(after.runs, 1);
  EXPECT_EQ(after.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(Admit(log, Call(6, true), &unknown));
  EXPECT_EQ(unknown.runs, 1);
  // The handler finishing later answers nobody twice.
  auto response = Response("late");
  log.Finished(*running, absl::OkStatus(), response.get());
  EXPECT_EQ(waiting.runs, 1);
}

TEST_F(CallLogTest, AStuckRecordDoesNotHoldBackExpiry) {
  CallLog log(Options(), kInstance);
  auto stuck = Call(10);
  Outcome unused;
  ASSERT_TRUE(Admit(log, stuck, &unused));  // its handler never returns
  for (uint64_t id = 11; id <= 20; ++id) {
    auto c = Call(id);
    ASSERT_TRUE(Admit(log, c, &unused));
    Deliver(log, *c);
  }
  EXPECT_EQ(log.stats().records, 11u);
  now_ += 30s + CallLog::kResendGrace + 1s;
  log.Sweep();
  EXPECT_EQ(log.stats().records, 1u) << "only the running call is kept";
  // The running call stays exactly-once past its window.
  Outcome repeat;
  EXPECT_FALSE(Admit(log, Call(10, true), &repeat));
  EXPECT_EQ(repeat.runs, 0);
  log.Finished(*stuck, absl::OkStatus(), nullptr);
  EXPECT_EQ(repeat.runs, 1);
  log.Delivered(*stuck);
  log.Sweep();
  EXPECT_EQ(log.stats().records, 0u);
  EXPECT_EQ(unused.runs, 0);
}

// The owner sweeps only when the log has work: nothing in an empty log,
// the oldest record's expiry, a waiting repeat's settle timeout. A call
// that brings work due before the planned sweep tells the owner
// (sweep_sooner); the calls after it do not.
TEST_F(CallLogTest, SweepsOnlyWhenWorkIsDue) {
  CallLog::Options options = Options();
  int told = 0;
  options.sweep_sooner = [&told] { ++told; };
  CallLog log(options, kInstance);
  EXPECT_EQ(log.Sweep(), Clock::time_point::max()) << "an empty log";
  const Clock::time_point began = now_;
  auto first = Call(1);
  Outcome unused, waiting;
  ASSERT_TRUE(Admit(log, first, &unused));
  EXPECT_EQ(told, 1) << "the first record of an empty log";
  now_ += 2s;
  auto second = Call(2);
  ASSERT_TRUE(Admit(log, second, &unused));
  EXPECT_EQ(told, 1) << "due after the sweep already planned";
  const Clock::time_point expiry = log.Sweep();
  EXPECT_GT(expiry, began + 30s);
  EXPECT_LE(expiry, began + 32s + CallLog::kResendGrace);
  // A repeat of a call whose response is being sent times out before the
  // first record expires: the owner is told.
  log.Finished(*second, absl::OkStatus(), nullptr);
  EXPECT_FALSE(Admit(log, Call(2, true), &waiting));
  EXPECT_EQ(told, 2);
  const Clock::time_point timeout = log.Sweep();
  EXPECT_GT(timeout, now_ + 10s);
  EXPECT_LT(timeout, expiry);
  now_ = timeout;
  EXPECT_EQ(log.Sweep(), expiry) << "the repeat answered, expiry is next";
  ASSERT_EQ(waiting.runs, 1);
  EXPECT_EQ(waiting.status->code(), absl::StatusCode::kUnavailable);
  Deliver(log, *first);
  log.Delivered(*second);
  now_ = expiry;
  EXPECT_EQ(log.Sweep(), expiry + 2s) << "the second record expires next";
  now_ = expiry + 2s;
  EXPECT_EQ(log.Sweep(), Clock::time_point::max()) << "all expired";
  EXPECT_EQ(log.stats().records, 0u);
  EXPECT_EQ(unused.runs, 0);
  ASSERT_TRUE(Admit(log, Call(3), &unused));
  EXPECT_EQ(told, 3) << "empty again, then a record";
}

// A running call pushed out of the expiry order by max_records waits as
// overdue until it settles: looked at every second, so the admission that
// pushed it tells the owner.
TEST_F(CallLogTest, ARecordPushedOverdueByTheCapBringsTheSweepForward) {
  CallLog::Options options = Options();
  options.max_records = 2;
  int told = 0;
  options.sweep_sooner = [&told] { ++told; };
  CallLog log(options, kInstance);
  Outcome unused;
  auto running = Call(1);
  ASSERT_TRUE(Admit(log, running, &unused));
  EXPECT_EQ(told, 1);
  EXPECT_GT(log.Sweep(), now_ + 30s);
  ASSERT_TRUE(Admit(log, Call(2), &unused));
  EXPECT_EQ(told, 1) << "within the cap";
  ASSERT_TRUE(Admit(log, Call(3), &unused));
  EXPECT_EQ(told, 2) << "the running call went overdue";
  EXPECT_LE(log.Sweep(), now_ + 1s);
  Deliver(log, *running);
  now_ += 1s;
  log.Sweep();
  EXPECT_EQ(log.stats().records, 2u) << "the settled overdue call is gone";
}

// The log holds at most max_records. A re-send of a call dropped inside
// its window to stay within them cannot be told apart from a new call, so
// it is refused rather than run again, even when the re-send took longer
// to come than the call's first send (its first send then looks later than
// the horizon of dropped records).
TEST_F(CallLogTest, RecordsOverTheCapMoveTheHorizon) {
  CallLog::Options options = Options();
  options.max_records = 4;
  CallLog log(options, kInstance);
  Outcome unused, repeat, newer;
  for (uint64_t id = 1; id <= 7; ++id) {
    auto c = Call(id);
    ASSERT_TRUE(Admit(log, c, &unused));
    Deliver(log, *c);
    now_ += 1ms;
  }
  EXPECT_EQ(log.stats().records, 4u) << "calls 4 to 7";
  // Call 3, the newest dropped, was admitted the moment it was sent; its
  // re-send was sent 3 ms later, and its first message took about 500 ms
  // to come.
  now_ += 500ms;
  auto resend = Call(3, true);
  resend->resend->age = 3ms;
  EXPECT_FALSE(Admit(log, resend, &repeat)) << "it would run a second time";
  ASSERT_EQ(repeat.runs, 1);
  EXPECT_EQ(repeat.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(repeat.status->message().find("SetCallLogMaxRecords"),
            std::string::npos)
      << *repeat.status;
  // A call first sent past the grace after the horizon, which the log has
  // not seen, runs.
  now_ += CallLog::kResendGrace;
  EXPECT_TRUE(Admit(log, Call(8, true), &newer));
  EXPECT_EQ(unused.runs, 0);
}

// At the limit, a repeat makes no room: the record it comes for stays,
// however old, and answers it.
TEST_F(CallLogTest, AtTheLimitARepeatOfTheOldestRecordIsAnswered) {
  CallLog::Options options = Options();
  options.max_records = 2;
  CallLog log(options, kInstance);
  Outcome unused, repeat;
  auto oldest = Call(1);
  ASSERT_TRUE(Admit(log, oldest, &unused));
  auto response = Response("kept");
  log.Finished(*oldest, absl::OkStatus(), response.get());
  log.Undelivered(oldest, absl::OkStatus(), std::move(response));
  auto newer = Call(2);
  ASSERT_TRUE(Admit(log, newer, &unused));
  EXPECT_FALSE(Admit(log, Call(1, true), &repeat));
  ASSERT_EQ(repeat.runs, 1);
  ASSERT_TRUE(repeat.status->ok()) << *repeat.status;
  EXPECT_EQ(LabelOf(repeat), "kept");
  EXPECT_EQ(log.stats().records, 2u);
}

// A re-send whose first message came inside the window, but whose request
// took past the record's expiry to arrive whole (a large tensor), is
// refused: its record may be gone.
TEST_F(CallLogTest, AReSendThatArrivesWholeAfterItsRecordExpiredIsRefused) {
  CallLog log(Options(), kInstance);
  auto first = Call(50);
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  Deliver(log, *first);
  now_ += 29s;
  auto resend = Call(50, true);  // its first message arrives now
  resend->resend->age = 29s;
  now_ += 6s;  // the record expires at 32 s
  EXPECT_FALSE(Admit(log, resend, &repeat)) << "it would run a second time";
  ASSERT_EQ(repeat.runs, 1);
  EXPECT_EQ(repeat.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(repeat.status->message().find("may have run"), std::string::npos)
      << *repeat.status;
  EXPECT_EQ(log.stats().records, 0u);
}

// A re-send is admitted by the age its client measured when it sent it;
// the record stays kResendGrace past the window, so a re-send sent just
// inside the window still finds it on arrival and is not run again.
TEST_F(CallLogTest, AReSendFromTheWindowsEndFindsItsRecord) {
  CallLog log(Options(), kInstance);
  auto first = Call(40);
  Outcome unused, repeat;
  ASSERT_TRUE(Admit(log, first, &unused));
  Deliver(log, *first);
  static_assert(CallLog::kResendGrace > 1s);
  now_ += 31s;  // past the window, inside the grace
  log.Sweep();
  auto resend = Call(40, true);
  resend->resend->age = 30s;
  EXPECT_FALSE(Admit(log, resend, &repeat)) << "it would run a second time";
  EXPECT_EQ(repeat.runs, 1);
  EXPECT_NE(repeat.status->message().find("already ran"), std::string::npos)
      << *repeat.status;
  EXPECT_EQ(unused.runs, 0);
}

TEST_F(CallLogTest, RepeatsFromAnotherServerInstanceOrTooOldAreRefused) {
  CallLog log(Options(), kInstance);
  Outcome restarted, old;
  EXPECT_FALSE(
      Admit(log, Call(30, true, /*instance=*/kInstance + 1), &restarted));
  EXPECT_EQ(restarted.status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(restarted.status->message().find("restarted"), std::string::npos);
  auto aged = Call(31, true);
  aged->resend->age = 31s;
  EXPECT_FALSE(Admit(log, aged, &old));
  EXPECT_EQ(old.status->code(), absl::StatusCode::kUnavailable);
  // A re-send the log has never seen, inside the window, runs.
  Outcome fresh;
  EXPECT_TRUE(Admit(log, Call(32, true), &fresh));
  EXPECT_EQ(fresh.runs, 0);
}

}  // namespace
}  // namespace rdmarpc::internal
