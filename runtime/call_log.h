// The server's record of recent calls, so that a call re-sent after a
// transport switch runs its handler at most once.
//
// A client that loses its RDMA connection cannot tell whether the calls in
// flight reached their handlers; it re-sends them over gRPC with the same
// (client id, call id). The server logs every call that may be re-sent
// (every RDMA call, and every re-send) before its handler runs:
//
//   if (!log.Admit(state, done)) return;     // a repeat: `done` is taken
//   run the handler, then log.Finished(*state, status, response.get());
//   the transport sends the response, then log.Delivered(*state), or
//   log.Undelivered(state, status, std::move(response)) if it could not.
//
// A repeat of a running call waits for it; a repeat of a call whose
// response is being sent waits to learn its fate, and abandons the
// connection it is sent on (ServerCallState::response_path): the client
// re-sends only after giving that connection up, and a lossy path could
// otherwise keep the sender retrying past the caller's deadline. A repeat
// of a call whose response could not be delivered gets that response (a
// copy of the message, the same tensor buffers); a repeat of a delivered
// call, of a
// call from before a server restart, or of one older than the window fails
// with UNAVAILABLE, never running the handler twice. A repeat never waits
// on a record that cannot settle: when the transport has not said within
// `settle_timeout` whether the response arrived, or the server shuts down
// (Close), the repeat gets UNAVAILABLE saying the call may have run.
// `window` is a re-send's age as its client measured it when it sent it
// (ServerCallState::Resend::age): a re-send at most that old is answered
// from its record, which is kept kResendGrace longer, so that one sent at
// the window's end still finds it: its first message must reach the
// server within kResendGrace of the client measuring its age
// (ServerCallState::Resend::arrived). A re-send the log does
// not know is run only where its record, had the call come before, would
// still be here: first sent (its first message's arrival less its age) within
// the window of now, and more than kResendGrace after the newest record
// dropped early to stay within max_records.
// Memory: one small record per call for `window` (30 s) and the grace, at
// most `max_records`; a record that outlives its window unsettled (a long
// handler) is dropped once it settles, so it never holds back the expiry
// of later ones. An undelivered response keeps its message and tensor
// buffers until it is delivered by a repeat or the window passes; a
// response on its request's arena (internal::RequestArena) keeps the
// request too, and whatever else the handler made on that arena.
//
// The owner calls Sweep() when it is due, so that waiting repeats time out
// and old records go without new traffic: Sweep returns when the next one
// has work, and Options::sweep_sooner tells the owner when a call brought
// work due before that. A log with nothing to expire is not swept at all
// (an idle server's sweeper sleeps).
#ifndef RDMARPC_RUNTIME_CALL_LOG_H_
#define RDMARPC_RUNTIME_CALL_LOG_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "google/protobuf/message.h"
#include "rdmarpc/status.h"
#include "runtime/coarse_clock.h"
#include "runtime/transport.h"

namespace rdmarpc::internal {

class CallLog {
 public:
  using Clock = std::chrono::steady_clock;
  // How long a record outlives the window it answers re-sends in.
  static constexpr std::chrono::seconds kResendGrace{2};
  struct Options {
    std::chrono::milliseconds window{30000};
    size_t max_records = size_t{1} << 18;
    // How long a repeat waits for the transport to report the fate of a
    // response it is sending.
    std::chrono::milliseconds settle_timeout{10000};
    // The time source (tests pass a fake one). Coarse: the log is read on
    // every logged call and its times are seconds long.
    std::function<Clock::time_point()> now = [] { return CoarseSteadyNow(); };
    // Runs a repeat's answer; inline when empty. (The server answers on a
    // worker: the log may answer from Delivered or Undelivered, which
    // transports call with their own locks held.)
    std::function<void(std::function<void()>)> run_repeat_answer;
    // Runs, with no lock held, when a call brings work due before the time
    // the last Sweep() returned: the first record of an empty log, a repeat
    // that waits on a response being sent. The owner sweeps sooner.
    std::function<void()> sweep_sooner;
  };
  struct Stats {
    uint64_t records = 0;           // now
    uint64_t repeats_answered = 0;  // from a record, handler not run
    uint64_t repeats_refused = 0;   // UNAVAILABLE: could not tell
  };

  // `server_instance`: random per server start; a re-send names the
  // instance it was first sent to.
  CallLog(Options options, uint64_t server_instance);

  uint64_t server_instance() const { return server_instance_; }

  // True: the caller runs the handler (a first arrival). False: a repeat;
  // `done` was moved from and runs with the recorded outcome, now or when
  // the first arrival finishes, or with UNAVAILABLE saying why the log
  // cannot answer. Requires state->client_id != 0.
  bool Admit(const std::shared_ptr<ServerCallState>& state,
             Dispatcher::Completion& done);
  // The handler of an admitted call returned. `response` (null on error)
  // and state.tensors must still hold what the handler made.
  void Finished(const ServerCallState& state, const Status& status,
                const google::protobuf::Message* response);
  // The response reached the client.
  void Delivered(const ServerCallState& state);
  // The transport could not deliver the response: keep it for a repeat.
  void Undelivered(std::shared_ptr<ServerCallState> state, Status status,
                   std::shared_ptr<google::protobuf::Message> response);

  // Expires old records and answers repeats that waited past
  // settle_timeout with UNAVAILABLE. Returns when the next sweep has work
  // (Clock::time_point::max(): none until a call comes).
  Clock::time_point Sweep();
  // The server is shutting down: every waiting repeat gets UNAVAILABLE now,
  // and later repeats of running or sending calls get it at once.
  void Close();

  Stats stats();

 private:
  using Key = std::pair<uint64_t, uint64_t>;  // client id, call id
  struct Waiter {
    std::shared_ptr<ServerCallState> state;
    Dispatcher::Completion done;
  };
  struct Record {
    enum class Stage { kRunning, kSending, kRetained, kDelivered };
    Stage stage = Stage::kRunning;
    Clock::time_point admitted;
    Clock::time_point finished;  // entered kSending
    std::vector<Waiter> waiters;
    // kRetained: the outcome, with the state whose tensors the response
    // refers to.
    Status status;
    std::shared_ptr<ServerCallState> state;
    std::shared_ptr<const google::protobuf::Message> response;
    // kSending: where the response goes out.
    std::weak_ptr<ResponsePath> path;
  };

  static Key KeyOf(const ServerCallState& state) {
    return {state.client_id, state.call_id};
  }
  static bool Settled(const Record& r) {
    return r.stage == Record::Stage::kRetained ||
           r.stage == Record::Stage::kDelivered;
  }
  // A record whose response's fate the transport has not reported in time.
  bool Stuck(const Record& r, Clock::time_point now) const {
    return r.stage == Record::Stage::kSending &&
           now - r.finished > options_.settle_timeout;
  }
  // Drops settled records past the window, and the oldest ones until
  // `room` more fit within max_records; unsettled ones leave the order for
  // overdue_, where Sweep drops them once they settle. True when that
  // makes a sweep due sooner (DueLocked). Requires mu_.
  bool ExpireLocked(Clock::time_point now, size_t room);
  // When the next sweep has work, from what the log holds now. Requires
  // mu_.
  Clock::time_point NextSweepLocked(Clock::time_point now) const;
  // Work comes due at `due`: true when that is before the planned sweep
  // (which then moves to `due`), and the owner must be told. Requires mu_.
  bool DueLocked(Clock::time_point due);
  // Erases `it`, moving its waiters (if any) to `answer`. Requires mu_.
  void DropLocked(absl::flat_hash_map<Key, Record>::iterator it,
                  Clock::time_point now, std::vector<Waiter>* answer);
  // Runs every waiter's completion with `why(call id)`; not under mu_.
  template <typename Why>
  static void Refuse(std::vector<Waiter>& waiters, Why why);
  // `done` of a repeat, made to run through options_.run_repeat_answer.
  Dispatcher::Completion AnswerAside(Dispatcher::Completion done) const;
  // Why a repeat of a call the log does not know cannot run, or OK.
  Status CheckUnknownRepeat(const ServerCallState& state,
                            Clock::time_point now) const;

  const Options options_;
  const uint64_t server_instance_;
  std::mutex mu_;
  absl::flat_hash_map<Key, Record> records_;
  std::deque<Key> order_;  // admission order, for expiry
  // Records with waiting repeats, and overdue ones, for Sweep.
  std::vector<Key> waited_on_;
  std::vector<Key> overdue_;
  // Admission time of the newest record dropped before its window (and
  // grace) passed.
  Clock::time_point horizon_{};
  // What the last Sweep() returned, moved earlier by DueLocked.
  Clock::time_point planned_sweep_ = Clock::time_point::max();
  bool closed_ = false;
  Stats stats_;
};

// Runs `done` with a copy of `response` whose tensors are bound in
// `target->tensors` to the buffers `source` binds for the original, and
// `source`'s response metadata copied to `target`.
void AnswerWithCopy(const Status& status,
                    const google::protobuf::Message* response,
                    const ServerCallState& source, ServerCallState* target,
                    const Dispatcher::Completion& done);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_CALL_LOG_H_
