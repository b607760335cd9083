// A fixed pool of threads running queued tasks in FIFO order. The threads
// carry `name` (at most 15 characters, as Linux allows) so that top, perf
// and debuggers tell them apart.
//
//   ThreadPool pool(4, "rdmarpc-worker");
//   pool.Post([] { ... });
#ifndef RDMARPC_RUNTIME_THREAD_POOL_H_
#define RDMARPC_RUNTIME_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
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

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_THREAD_POOL_H_
