#include "runtime/completion.h"

#include <utility>

#include "runtime/thread_pool.h"

namespace rdmarpc::internal {

void RunOnCallbackThread(std::function<void()> task) {
  // Never destroyed: completions may be posted during static destruction.
  static ThreadPool* pool = new ThreadPool(2, "rdmarpc-done");
  pool->Post(std::move(task));
}

namespace {
thread_local bool completion_thread = false;
thread_local std::shared_ptr<CallerPoll> offered_poll;
thread_local PollerHooks* thread_poller = nullptr;
thread_local bool in_inline_handler = false;
thread_local bool inline_handler_blocked = false;
}  // namespace

void MarkCompletionThread(bool on) { completion_thread = on; }
bool OnCompletionThread() { return completion_thread; }

PollerHooks* ThreadPoller() { return thread_poller; }
void SetThreadPoller(PollerHooks* poller) { thread_poller = poller; }
bool OnPollerThread() { return completion_thread || thread_poller != nullptr; }

void BeforeBlockingCall() {
  if (thread_poller != nullptr) thread_poller->LeaveBeforeBlocking();
  if (in_inline_handler) inline_handler_blocked = true;
}
InlineHandlerScope::InlineHandlerScope() : was_(in_inline_handler) {
  in_inline_handler = true;
}
InlineHandlerScope::~InlineHandlerScope() { in_inline_handler = was_; }
bool TakeInlineHandlerBlocked() {
  return std::exchange(inline_handler_blocked, false);
}

CompletionThreadScope::CompletionThreadScope() : was_(completion_thread) {
  completion_thread = true;
}
CompletionThreadScope::~CompletionThreadScope() { completion_thread = was_; }

void OfferCallerPoll(std::shared_ptr<CallerPoll> poll) {
  offered_poll = std::move(poll);
}
std::shared_ptr<CallerPoll> TakeCallerPoll() { return std::move(offered_poll); }

void DeferredCompletion::Arm(std::function<void(Status)> done, Status status,
                             bool run_inline) {
  done_ = std::move(done);
  status_ = std::move(status);
  // A default id names no thread: the destructor hands `done` on.
  if (run_inline) armed_on_ = std::this_thread::get_id();
}

DeferredCompletion::~DeferredCompletion() {
  if (!done_) return;
  if (std::this_thread::get_id() == armed_on_) {
    done_(std::move(status_));
    return;
  }
  RunOnCallbackThread(
      [done = std::move(done_), status = std::move(status_)] { done(status); });
}

}  // namespace rdmarpc::internal
