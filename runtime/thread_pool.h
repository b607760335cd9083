// A pool of threads taking queued tasks in FIFO order. The threads carry
// `name` (a string literal: at most 15 characters, as Linux allows) so that
// top, perf and debuggers tell them apart.
//
//   ThreadPool pool(4, "rdmarpc-worker");
//   pool.Post([] { ... });
//
// A pool made with Growth::kWhileBlocked (the server's workers) keeps
// `threads` threads for its queue while some wait in a call of ours: a
// task that blocks in Channel::Call marks the wait with a BlockedScope,
// and a task queued while no thread is free then starts one. The call it
// waits for may need a thread of this pool itself (a handler that calls
// its own server, or a chain of servers that comes back to this one), and
// with a fixed pool enough such waits at once would wait for each other
// until their deadlines. A thread beyond `threads` leaves after
// kLeaveAfter without a task. Tasks then start in FIFO order but may run
// at the same time as ones queued before them; fixed pools run their tasks
// one after another on each thread, as before.
#ifndef RDMARPC_RUNTIME_THREAD_POOL_H_
#define RDMARPC_RUNTIME_THREAD_POOL_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

namespace rdmarpc::internal {

class ThreadPool {
 public:
  enum class Growth { kFixed, kWhileBlocked };
  ThreadPool(int threads, const char* name, Growth growth = Growth::kFixed);
  // Runs the tasks still queued, then joins the threads.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Post(std::function<void()> task);

  // Marks the calling thread, if it is a thread of a kWhileBlocked pool,
  // as waiting for a call of ours while it lives; does nothing elsewhere.
  class BlockedScope {
   public:
    BlockedScope();
    ~BlockedScope();
    BlockedScope(const BlockedScope&) = delete;
    BlockedScope& operator=(const BlockedScope&) = delete;

   private:
    ThreadPool* pool_;
  };

  // Threads now, counting those started for tasks that wait (tests).
  int threads_for_test();

  // How long a thread beyond `threads` waits for a task before it leaves:
  // long enough that a steady load of blocking calls does not start and end
  // a thread per call.
  static constexpr std::chrono::seconds kLeaveAfter{1};

 private:
  using Threads = std::list<std::thread>;
  // At most this many threads beyond `threads` while others wait.
  static constexpr int kMaxExtraThreads = 1024;

  void Loop(Threads::iterator self);
  // Starts a thread if more tasks are queued than threads wait for them,
  // and fewer than `threads` are outside calls.
  void GrowIfStarvedLocked();
  // False when no thread could be made.
  bool StartLocked();

  const int wanted_;
  const char* const name_;
  const Growth growth_;
  std::mutex mu_;
  std::condition_variable cv_;    // a task is queued, or stopping_
  std::condition_variable gone_;  // alive_ fell to 0 (stopping_)
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  int alive_ = 0;    // threads running Loop
  int idle_ = 0;     // of them, waiting for a task
  int blocked_ = 0;  // of them, in a BlockedScope
  Threads threads_;
  // The last thread that left (beyond `threads`), to be joined by the next
  // one that leaves, or by the destructor.
  std::vector<std::thread> left_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_THREAD_POOL_H_
