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
}  // namespace

void MarkCompletionThread() { completion_thread = true; }
bool OnCompletionThread() { return completion_thread; }

void DeferredCompletion::Arm(std::function<void(Status)> done, Status status) {
  done_ = std::move(done);
  status_ = std::move(status);
  armed_on_ = std::this_thread::get_id();
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
