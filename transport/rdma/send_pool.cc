#include "transport/rdma/send_pool.h"

#include <algorithm>
#include <cstdlib>

namespace rdmarpc::rdma {

FreeIndexStack::FreeIndexStack(uint32_t capacity)
    : capacity_(capacity), below_(new std::atomic<uint32_t>[capacity]) {
  // Index 0 on top, then 1, ...
  for (uint32_t i = 0; i < capacity; ++i) {
    below_[i].store(i + 1 < capacity ? i + 2 : 0, std::memory_order_relaxed);
  }
  head_.store(capacity > 0 ? 1 : 0, std::memory_order_release);
  size_.store(capacity, std::memory_order_relaxed);
}

int FreeIndexStack::Pop() {
  uint64_t head = head_.load(std::memory_order_acquire);
  for (;;) {
    const auto top = static_cast<uint32_t>(head);
    if (top == 0) return -1;
    // Stale when another thread popped `top` meanwhile: the tag then
    // differs and the exchange fails.
    const uint32_t below = below_[top - 1].load(std::memory_order_relaxed);
    const uint64_t next = ((head & ~uint64_t{0xffffffff}) + kTagOne) | below;
    if (head_.compare_exchange_weak(head, next, std::memory_order_acquire,
                                    std::memory_order_acquire)) {
      size_.fetch_sub(1, std::memory_order_relaxed);
      return static_cast<int>(top - 1);
    }
  }
}

void FreeIndexStack::Push(int index) {
  const auto slot = static_cast<uint32_t>(index);
  uint64_t head = head_.load(std::memory_order_relaxed);
  for (;;) {
    below_[slot].store(static_cast<uint32_t>(head), std::memory_order_relaxed);
    const uint64_t next =
        ((head & ~uint64_t{0xffffffff}) + kTagOne) | (slot + 1);
    // Release: what the giver did with the buffer happens before the next
    // taker's use of it.
    if (head_.compare_exchange_weak(head, next, std::memory_order_release,
                                    std::memory_order_relaxed)) {
      size_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
}

uint32_t SendPool::BuffersFromEnvironment() {
  const char* env = std::getenv("RDMARPC_RDMA_SEND_POOL_BUFFERS");
  if (env == nullptr || *env == '\0') return kDefaultBuffers;
  return static_cast<uint32_t>(
      std::min<unsigned long>(std::strtoul(env, nullptr, 10), kMaxBuffers));
}

SendPool::SendPool(uint32_t buffers, uint32_t buffer_bytes)
    : buffer_bytes_(buffer_bytes),
      bytes_(new uint8_t[size_t{buffers} * buffer_bytes]),
      free_(buffers) {}

StatusOr<std::unique_ptr<SendPool>> SendPool::Create(ibv_pd* pd,
                                                     uint32_t buffers,
                                                     uint32_t buffer_bytes) {
  if (buffers == 0 || buffer_bytes == 0) {
    return absl::InvalidArgumentError("a send pool needs buffers");
  }
  std::unique_ptr<SendPool> pool(new SendPool(buffers, buffer_bytes));
  RDMARPC_ASSIGN_OR_RETURN(pool->mr_,
                           RegisterMemory(pd, pool->bytes_.get(),
                                          size_t{buffers} * buffer_bytes, 0));
  return pool;
}

}  // namespace rdmarpc::rdma
