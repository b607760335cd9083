#include "runtime/call_log.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/tensor_walk.h"

namespace rdmarpc::internal {

using google::protobuf::Message;

namespace {

Status AlreadyDelivered(uint64_t call_id) {
  return absl::UnavailableError(
      absl::StrCat("call ", call_id,
                   " already ran and its response was delivered before this "
                   "re-send arrived; it is not run again"));
}

Status FateUnknown(uint64_t call_id) {
  return absl::UnavailableError(absl::StrCat(
      "call ", call_id,
      " ran, but the server could not tell in time whether its response "
      "reached the client; it is not run again (it may have run)"));
}

Status ResentElsewhere(uint64_t call_id) {
  return absl::UnavailableError(absl::StrCat(
      "the client re-sent call ", call_id,
      " over another transport while its response was being sent on this "
      "connection: the client has left it"));
}

Status ShuttingDown(uint64_t call_id) {
  return absl::UnavailableError(
      absl::StrCat("the server is shutting down while call ", call_id,
                   " is re-sent; it is not run again (it may have run)"));
}

}  // namespace

void AnswerWithCopy(const Status& status, const Message* response,
                    const ServerCallState& source, ServerCallState* target,
                    const Dispatcher::Completion& done) {
  // The repeat's answer is the first run's, metadata included.
  target->initial_metadata = source.initial_metadata;
  target->trailing_metadata = source.trailing_metadata;
  if (!status.ok() || response == nullptr) return done(status, nullptr);
  std::unique_ptr<Message> copy(response->New());
  copy->CopyFrom(*response);
  // Same message, same walk: the k-th tensor of the copy is the k-th of the
  // original, so it gets the original's buffer.
  TensorList from;
  MutableTensorList to;
  Status walked = CollectTensors(*response, &from);
  if (walked.ok()) walked = CollectMutableTensors(copy.get(), &to);
  if (!walked.ok()) return done(walked, nullptr);
  target->tensors.Clear();
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    if (const TensorBuffer* b =
            CallTensorsAccess::Find(source.tensors, *from[i])) {
      CallTensorsAccess::Bind(&target->tensors, *to[i], *b);
    }
  }
  done(absl::OkStatus(), std::move(copy));
}

CallLog::CallLog(Options options, uint64_t server_instance)
    : options_(options), server_instance_(server_instance) {}

Status CallLog::CheckUnknownRepeat(const ServerCallState& state,
                                   Clock::time_point now) const {
  if (!state.resend) return absl::OkStatus();
  const ServerCallState::Resend& r = *state.resend;
  std::string call = absl::StrCat("call ", state.call_id, " (",
                                  state.method().descriptor.path, ")");
  if (r.server_instance != server_instance_) {
    return absl::UnavailableError(absl::StrCat(
        call,
        " was re-sent after its RDMA connection failed, but the server has "
        "restarted since it was first sent; it is not run again (it may "
        "have run before the restart)"));
  }
  if (r.age > options_.window) {
    return absl::UnavailableError(absl::StrCat(
        call, " was re-sent ", r.age.count(),
        " ms after it was first sent, beyond what the server's call log "
        "still covers; it is not run again (it may have run)"));
  }
  // When the call was first sent, by this clock, give or take the re-send
  // first message's way here (at most kResendGrace). Its record, had it come,
  // was admitted later and kept at least the window and the grace past that.
  const auto sent = r.arrived - r.age;
  if (now - sent > options_.window) {
    return absl::UnavailableError(absl::StrCat(
        call, " was re-sent ", r.age.count(),
        " ms after it was first sent and reached its handler ",
        std::chrono::duration_cast<std::chrono::milliseconds>(now - sent)
            .count(),
        " ms after it, beyond what the server's call log still covers; it "
        "is not run again (it may have run)"));
  }
  // A record dropped over max_records was admitted by horizon_, which may
  // be before `sent` by as much as that way.
  if (sent <= horizon_ + kResendGrace) {
    return absl::UnavailableError(absl::StrCat(
        call,
        " was first sent before calls the server's call log has already "
        "dropped to stay within its limit "
        "(ServerBuilder::SetCallLogMaxRecords); it is not run again (it "
        "may have run)"));
  }
  return absl::OkStatus();
}

Dispatcher::Completion CallLog::AnswerAside(Dispatcher::Completion done) const {
  if (!options_.run_repeat_answer) return done;
  return [run = options_.run_repeat_answer, done = std::move(done)](
             Status s, std::shared_ptr<Message> response) {
    run([done, s = std::move(s), response = std::move(response)] {
      done(s, response);
    });
  };
}

template <typename Why>
void CallLog::Refuse(std::vector<Waiter>& waiters, Why why) {
  for (Waiter& w : waiters) w.done(why(w.state->call_id), nullptr);
}

void CallLog::DropLocked(absl::flat_hash_map<Key, Record>::iterator it,
                         Clock::time_point now, std::vector<Waiter>* answer) {
  Record& r = it->second;
  // A re-send of a call dropped inside its window must not run it again.
  if (now - r.admitted <= options_.window + kResendGrace) {
    horizon_ = std::max(horizon_, r.admitted);
  }
  for (Waiter& w : r.waiters) answer->push_back(std::move(w));
  records_.erase(it);
}

// Records expire together, at most one sweep a second while they do; a
// waiting repeat times out a little after its settle timeout. Both leave
// room for the coarse clock the log reads to catch up with the wake-up.
constexpr auto kExpirySlack = std::chrono::seconds(1);
constexpr auto kTimeoutSlack = std::chrono::milliseconds(50);

CallLog::Clock::time_point CallLog::NextSweepLocked(
    Clock::time_point now) const {
  auto next = Clock::time_point::max();
  // A record overdue but unsettled (a handler past the window) is dropped
  // once it settles, which no call tells the sweeper: looked at every
  // second meanwhile.
  if (!overdue_.empty()) next = now + kExpirySlack;
  for (const Key& key : order_) {
    auto it = records_.find(key);
    if (it == records_.end()) continue;
    next = std::min(next, it->second.admitted + options_.window + kResendGrace +
                              kExpirySlack);
    break;
  }
  for (const Key& key : waited_on_) {
    auto it = records_.find(key);
    if (it == records_.end() || it->second.stage != Record::Stage::kSending) {
      continue;  // a running call's waiters are answered when it finishes
    }
    next = std::min(
        next, it->second.finished + options_.settle_timeout + kTimeoutSlack);
  }
  return next;
}

bool CallLog::DueLocked(Clock::time_point due) {
  if (due >= planned_sweep_) return false;
  planned_sweep_ = due;
  return options_.sweep_sooner != nullptr;
}

bool CallLog::ExpireLocked(Clock::time_point now, size_t room) {
  bool sweep_sooner = false;
  std::vector<Waiter> unused;
  while (!order_.empty()) {
    auto it = records_.find(order_.front());
    if (it == records_.end()) {
      order_.pop_front();
      continue;
    }
    Record& r = it->second;
    bool old = now - r.admitted > options_.window + kResendGrace;
    bool over = records_.size() - overdue_.size() + room > options_.max_records;
    if (!old && !over) break;
    order_.pop_front();
    if (Settled(r)) {
      DropLocked(it, now, &unused);  // settled: no waiters
    } else {
      overdue_.push_back(it->first);
      sweep_sooner |= DueLocked(now + kExpirySlack);
    }
  }
  return sweep_sooner;
}

bool CallLog::Admit(const std::shared_ptr<ServerCallState>& state,
                    Dispatcher::Completion& done) {
  bool sweep_sooner = false;
  // Declared before the lock, so it runs after the lock is released.
  absl::Cleanup tell_owner = [&] {
    if (sweep_sooner) options_.sweep_sooner();
  };
  std::unique_lock<std::mutex> lock(mu_);
  auto now = options_.now();
  // Room for a new record (records over max_records may go overdue here),
  // but not by dropping the record a repeat comes for.
  const bool full = records_.size() - overdue_.size() >= options_.max_records;
  sweep_sooner =
      ExpireLocked(now, full && !records_.contains(KeyOf(*state)) ? 1 : 0);
  auto [it, first] = records_.try_emplace(KeyOf(*state));
  if (first) {
    Status refused = closed_ ? ShuttingDown(state->call_id)
                             : CheckUnknownRepeat(*state, now);
    if (!refused.ok()) {
      records_.erase(it);
      ++stats_.repeats_refused;
      lock.unlock();
      Dispatcher::Completion take = AnswerAside(std::move(done));
      take(refused, nullptr);
      return false;
    }
    it->second.admitted = now;
    order_.push_back(KeyOf(*state));
    sweep_sooner |=
        DueLocked(now + options_.window + kResendGrace + kExpirySlack);
    return true;
  }
  Record& r = it->second;
  Status status;
  std::shared_ptr<ServerCallState> source;
  std::shared_ptr<const Message> response;
  switch (r.stage) {
    case Record::Stage::kRunning:
    case Record::Stage::kSending:
      if (closed_ || Stuck(r, now)) {
        ++stats_.repeats_refused;
        status = closed_ ? ShuttingDown(state->call_id)
                         : FateUnknown(state->call_id);
        break;
      }
      if (r.waiters.empty()) waited_on_.push_back(it->first);
      r.waiters.push_back({state, AnswerAside(std::move(done))});
      if (r.stage == Record::Stage::kSending) {
        sweep_sooner |=
            DueLocked(r.finished + options_.settle_timeout + kTimeoutSlack);
      }
      if (std::shared_ptr<ResponsePath> path = r.path.lock()) {
        lock.unlock();  // the close reports Undelivered, which takes mu_
        path->Abandon(ResentElsewhere(state->call_id));
      }
      return false;
    case Record::Stage::kRetained:
      ++stats_.repeats_answered;
      status = r.status;
      source = r.state;
      response = r.response;
      break;
    case Record::Stage::kDelivered:
      ++stats_.repeats_refused;
      status = AlreadyDelivered(state->call_id);
      break;
  }
  // Answered outside the lock: the transport's completion may call back.
  lock.unlock();
  Dispatcher::Completion answer = AnswerAside(std::move(done));
  if (source) {
    AnswerWithCopy(status, response.get(), *source, state.get(), answer);
  } else {
    answer(status, nullptr);
  }
  return false;
}

void CallLog::Finished(const ServerCallState& state, const Status& status,
                       const Message* response) {
  std::vector<Waiter> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(KeyOf(state));
    if (it == records_.end()) return;
    it->second.stage = Record::Stage::kSending;
    it->second.finished = options_.now();
    it->second.path = state.response_path;
    waiters.swap(it->second.waiters);
    stats_.repeats_answered += waiters.size();
  }
  for (Waiter& w : waiters) {
    AnswerWithCopy(status, response, state, w.state.get(), w.done);
  }
}

void CallLog::Delivered(const ServerCallState& state) {
  std::vector<Waiter> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(KeyOf(state));
    if (it == records_.end()) return;
    Record& r = it->second;
    r.stage = Record::Stage::kDelivered;
    r.state.reset();
    r.response.reset();
    r.path.reset();
    waiters.swap(r.waiters);
    stats_.repeats_refused += waiters.size();
  }
  Refuse(waiters, AlreadyDelivered);
}

void CallLog::Undelivered(std::shared_ptr<ServerCallState> state, Status status,
                          std::shared_ptr<Message> response) {
  std::vector<Waiter> waiters;
  std::shared_ptr<const Message> kept(std::move(response));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(KeyOf(*state));
    if (it == records_.end()) return;
    Record& r = it->second;
    if (r.stage == Record::Stage::kDelivered) return;  // a repeat did
    r.stage = Record::Stage::kRetained;
    r.path.reset();
    r.status = status;
    r.state = state;
    r.response = kept;
    waiters.swap(r.waiters);
    stats_.repeats_answered += waiters.size();
  }
  for (Waiter& w : waiters) {
    AnswerWithCopy(status, kept.get(), *state, w.state.get(), w.done);
  }
}

CallLog::Clock::time_point CallLog::Sweep() {
  std::vector<Waiter> timed_out;
  Clock::time_point next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = options_.now();
    ExpireLocked(now, 0);
    std::erase_if(waited_on_, [&](const Key& key) {
      auto it = records_.find(key);
      if (it == records_.end() || it->second.waiters.empty()) return true;
      if (!Stuck(it->second, now)) return false;
      for (Waiter& w : it->second.waiters) timed_out.push_back(std::move(w));
      it->second.waiters.clear();
      return true;
    });
    std::erase_if(overdue_, [&](const Key& key) {
      auto it = records_.find(key);
      if (it == records_.end()) return true;
      if (!Settled(it->second) && !Stuck(it->second, now)) return false;
      DropLocked(it, now, &timed_out);
      return true;
    });
    stats_.repeats_refused += timed_out.size();
    next = NextSweepLocked(now);
    planned_sweep_ = next;
  }
  Refuse(timed_out, FateUnknown);
  return next;
}

void CallLog::Close() {
  std::vector<Waiter> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (const Key& key : waited_on_) {
      auto it = records_.find(key);
      if (it == records_.end()) continue;
      for (Waiter& w : it->second.waiters) waiting.push_back(std::move(w));
      it->second.waiters.clear();
    }
    waited_on_.clear();
    stats_.repeats_refused += waiting.size();
  }
  Refuse(waiting, ShuttingDown);
}

CallLog::Stats CallLog::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  s.records = records_.size();
  return s;
}

}  // namespace rdmarpc::internal
