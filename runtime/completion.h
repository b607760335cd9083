// Runs a call's completion callback once the last holder lets go.
//
// A transport arms it when the call is done; zero-copy slices that still
// reference the call's borrowed memory hold it too, so the user's callback
// (after which the memory may be freed) waits until the transport no longer
// reads it. Runs inline when released on the arming thread (if the call
// allows it), else on a runtime thread, never from inside the transport's
// internals.
#ifndef RDMARPC_RUNTIME_COMPLETION_H_
#define RDMARPC_RUNTIME_COMPLETION_H_

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "rdmarpc/status.h"

namespace rdmarpc::internal {

class DeferredCompletion {
 public:
  DeferredCompletion() = default;
  DeferredCompletion(const DeferredCompletion&) = delete;
  DeferredCompletion& operator=(const DeferredCompletion&) = delete;
  ~DeferredCompletion();

  // Sets what runs on release. Call once, before dropping the owner's ref.
  // `run_inline` false: `done` runs on a runtime thread even when released
  // on the arming thread (ClientCall::done_runs_inline).
  void Arm(std::function<void(Status)> done, Status status, bool run_inline);

 private:
  std::function<void(Status)> done_;
  Status status_;
  std::thread::id armed_on_;
};

// Runs `task` on the runtime's own callback thread.
void RunOnCallbackThread(std::function<void()> task);

// User code run on a completion thread (an inline handler or callback)
// that holds it this long counts as a stall of every connection it serves.
inline constexpr std::chrono::milliseconds kCompletionThreadStall{1};

// Marks the calling thread as one that completes calls (the RDMA
// completion engine while it polls): a blocking call made on it would wait
// for itself. `on` false clears the mark.
void MarkCompletionThread(bool on = true);
bool OnCompletionThread();

// What a poller thread (the RDMA engine) offers the server code it runs.
// Set on the thread while it holds the poller (SetThreadPoller), null on
// every other thread.
//
//   if (PollerHooks* poller = ThreadPoller()) {
//     queue_.push_back(...);               // thread-local queue of handlers
//     poller->RunAfterBatch(&DrainQueue);  // runs once no queue is polled
//   }
class PollerHooks {
 public:
  // Runs `drain` on this thread once it holds no connection's queue (after
  // the batch of completions it is handling), so code `drain` runs may
  // block without stalling that connection's own events (its cancels).
  // Each function runs once per batch however often it is asked for.
  virtual void RunAfterBatch(void (*drain)()) = 0;
  // Code run by a drain that is about to block (a handler making a
  // blocking call): another thread takes over the poller's connections
  // now. Returns false where blocking stays unsafe (this thread does not
  // hold the poller, or holds a queue).
  virtual bool LeaveBeforeBlocking() = 0;

 protected:
  ~PollerHooks() = default;
};
PollerHooks* ThreadPoller();
void SetThreadPoller(PollerHooks* poller);
// Called by a blocking call of ours (Channel::Call, CallFuture) before it
// blocks: a handler run by a poller hands the poller on
// (LeaveBeforeBlocking), and a handler run inline on any transport's
// thread is noted as one that blocks (TakeInlineHandlerBlocked, for the
// dispatcher, which moves its method to the workers).
void BeforeBlockingCall();
// Marks the calling thread as running a handler inline while it lives.
class InlineHandlerScope {
 public:
  InlineHandlerScope();
  ~InlineHandlerScope();
  InlineHandlerScope(const InlineHandlerScope&) = delete;
  InlineHandlerScope& operator=(const InlineHandlerScope&) = delete;

 private:
  bool was_;
};
// Whether the inline handler of this thread made a blocking call since the
// last call.
bool TakeInlineHandlerBlocked();
// Whether the thread serves connections (polls them, or runs handlers
// between its polls): slow work (pinning memory) belongs elsewhere.
bool OnPollerThread();
// Marks the calling thread so while it polls for its own call.
class CompletionThreadScope {
 public:
  CompletionThreadScope();
  ~CompletionThreadScope();
  CompletionThreadScope(const CompletionThreadScope&) = delete;
  CompletionThreadScope& operator=(const CompletionThreadScope&) = delete;

 private:
  bool was_;
};

// A completion queue that the thread waiting for its own call polls while
// it spins (Channel::Call): the call then completes on that thread, with
// no hand-off from the engine. The transport that carries a caller-driven
// call offers the queue on the calling thread; the waiter takes it, polls
// it alone for its spin, and gives it back before it sleeps.
//
//   if (poll->TakeForCaller()) {
//     while (!done && spinning) poll->PollTaken();
//     poll->GiveBack();
//   } else if (!done) {
//     poll->HandToEngine();  // before the waiter sleeps
//   }
class CallerPoll {
 public:
  virtual ~CallerPoll() = default;
  // Takes the queue from the engine; false while another thread polls it
  // (try again) or once it is closed.
  virtual bool TakeForCaller() = 0;
  // Handles what completed (the caller's response, and anything else on
  // the queue); true if it found anything. Only between a successful
  // TakeForCaller and GiveBack.
  virtual bool PollTaken() = 0;
  // Gives the queue back; the engine polls for the calls left on it.
  virtual void GiveBack() = 0;
  // A waiter that goes to sleep without having taken the queue: the engine
  // polls for its call.
  virtual void HandToEngine() = 0;
};
void OfferCallerPoll(std::shared_ptr<CallerPoll> poll);
std::shared_ptr<CallerPoll> TakeCallerPoll();

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_COMPLETION_H_
