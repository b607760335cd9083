// A pool of threads running queued tasks in FIFO order. The threads carry
// `name` (at most 15 characters, as Linux allows) so that top, perf and
// debuggers tell them apart.
//
//   ThreadPool pool(4, "rdmarpc-worker");
//   pool.Post([] { ... });
//
// A task that blocks in a call of ours (Channel::Call) marks the wait with
// a BlockedScope. While it waits the pool keeps `threads` others for the
// queue, starting more when tasks wait and none is free: the call it waits
// for may need a thread of this pool itself (a handler that calls its own
// server, or a chain of servers that comes back to this one), and with a
// fixed pool enough such waits at once would wait for each other until
// their deadlines. Threads beyond `threads` leave once the waits are over.
#ifndef RDMARPC_RUNTIME_THREAD_POOL_H_
#define RDMARPC_RUNTIME_THREAD_POOL_H_

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
  ThreadPool(int threads, const char* name);
  // Runs the tasks still queued, then joins the threads.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Post(std::function<void()> task);

  // Marks the calling thread, if it is a pool's, as waiting for a call of
  // ours while it lives; does nothing on other threads.
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

 private:
  using Threads = std::list<std::thread>;
  // At most this many threads beyond `threads` while others wait.
  static constexpr int kMaxExtraThreads = 1024;

  void Loop(Threads::iterator self);
  // Starts a thread if tasks are queued, none is free to take them, and
  // fewer than `threads` are not waiting in a call.
  void GrowIfStarvedLocked();
  // False when no thread could be made.
  bool StartLocked();

  const int wanted_;
  const char* const name_;
  std::mutex mu_;
  std::condition_variable cv_;    // a task is queued, or stopping_
  std::condition_variable gone_;  // alive_ fell to 0 (stopping_)
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  int alive_ = 0;    // threads running Loop
  int idle_ = 0;     // of them, waiting for a task
  int blocked_ = 0;  // of them, in a BlockedScope
  Threads threads_;
  // Threads that left (beyond `threads`); joined by the next start or the
  // destructor.
  std::vector<std::thread> left_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_THREAD_POOL_H_
