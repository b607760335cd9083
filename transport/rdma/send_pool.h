// Send buffers a completion group lends to its members, so that a
// connection that sends little holds none of its own: the buffers a quiet
// connection's frames need come from one registration per group instead of
// a chunk pinned per connection.
//
//   RDMARPC_ASSIGN_OR_RETURN(std::unique_ptr<SendPool> pool,
//                            SendPool::Create(pd, 16, 32 << 10));
//   int b = pool->Take();            // -1: none free
//   if (b >= 0) {
//     encode into pool->buffer(b); post it with pool->lkey(), signaled;
//     pool->Give(b);                 // once its completion came
//   }
//
// A connection borrows from its group's pool until it has sent
// kBorrowedFramesBeforeOwn frames through it (or finds it empty), then
// registers send buffers of its own (connection.h). A
// borrowed buffer goes back when its frame's send completed, or once the
// connection's queue pair is destroyed: never while the device may still
// read it.
//
// Take and Give are lock-free and may run on any thread. The pool's memory
// is registered in the group's protection domain for local access only,
// and goes with the group, after the queue pairs of its members.
#ifndef RDMARPC_TRANSPORT_RDMA_SEND_POOL_H_
#define RDMARPC_TRANSPORT_RDMA_SEND_POOL_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "rdmarpc/status.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

// A lock-free stack of the indices 0..capacity-1 (a Treiber stack whose
// head carries a tag, so a pop that raced a pop and a push of the same
// index fails its exchange instead of linking a stale next).
class FreeIndexStack {
 public:
  // Holds every index to begin with.
  explicit FreeIndexStack(uint32_t capacity);

  // An index, or -1 when the stack is empty.
  int Pop();
  // Returns an index Pop handed out (each at most once).
  void Push(int index);
  // How many are in the stack; exact only while no thread pops or pushes.
  uint32_t size() const { return size_.load(std::memory_order_relaxed); }
  uint32_t capacity() const { return capacity_; }

 private:
  static constexpr uint64_t kTagOne = uint64_t{1} << 32;
  const uint32_t capacity_;
  // Per index: 1 + the index below it in the stack (0: none).
  std::unique_ptr<std::atomic<uint32_t>[]> below_;
  // Low 32 bits: 1 + the top index (0: empty); high 32 bits: a tag bumped
  // by every change.
  std::atomic<uint64_t> head_{0};
  std::atomic<uint32_t> size_{0};
};

class SendPool {
 public:
  // Buffers lent per group unless RDMARPC_RDMA_SEND_POOL_BUFFERS says
  // otherwise (0: no pool, each connection registers its own from the
  // start; at most kMaxBuffers).
  static constexpr uint32_t kDefaultBuffers = 16;
  static constexpr uint32_t kMaxBuffers = 4096;
  static uint32_t BuffersFromEnvironment();

  // `buffers` of `buffer_bytes` each, registered in `pd` (which must
  // outlive the pool) for local access.
  [[nodiscard]] static StatusOr<std::unique_ptr<SendPool>> Create(
      ibv_pd* pd, uint32_t buffers, uint32_t buffer_bytes);

  int Take() { return free_.Pop(); }
  void Give(int index) { free_.Push(index); }

  uint8_t* buffer(int index) const {
    return bytes_.get() + size_t(static_cast<uint32_t>(index)) * buffer_bytes_;
  }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t buffer_bytes() const { return buffer_bytes_; }
  uint32_t buffers() const { return free_.capacity(); }
  // Not lent now (exact only while no member sends).
  uint32_t free_buffers() const { return free_.size(); }

 private:
  SendPool(uint32_t buffers, uint32_t buffer_bytes);

  const uint32_t buffer_bytes_;
  std::unique_ptr<uint8_t[]> bytes_;
  MemoryRegion mr_;
  FreeIndexStack free_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_SEND_POOL_H_
