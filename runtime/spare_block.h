// One spare heap block for a per-call record: a record given back keeps its
// memory for the next Take, so an endpoint with one call at a time (a
// blocking caller, a latency-bound loop) makes no heap allocation for its
// records. Records over 1 KiB miss glibc's per-thread cache, and freeing
// one made on another thread takes its arena's lock: the block skips both.
// Take and Give may race from any threads; each is one atomic exchange.
//
//   SpareBlock<CallRecord> spare;
//   std::unique_ptr<CallRecord> r = spare.Take();  // a fresh CallRecord
//   ...
//   spare.Give(std::move(r));  // destroyed now; its memory kept
//
// Take default-initializes, so T must give every member of its own an
// initializer: a value-initialized (`T()`) record of 1 KiB was zeroed
// whole before its constructor ran, about 270 instructions a call.
// A record that is never given back is freed by its unique_ptr as usual.
// Under ASan the kept block is poisoned, so a stale pointer into a record
// given back still reads as a use after free.
#ifndef RDMARPC_RUNTIME_SPARE_BLOCK_H_
#define RDMARPC_RUNTIME_SPARE_BLOCK_H_

#include <sanitizer/asan_interface.h>

#include <atomic>
#include <memory>
#include <new>

namespace rdmarpc::internal {

template <typename T>
class SpareBlock {
 public:
  SpareBlock() = default;
  SpareBlock(const SpareBlock&) = delete;
  SpareBlock& operator=(const SpareBlock&) = delete;
  ~SpareBlock() {
    if (void* block = slot_.exchange(nullptr, std::memory_order_acquire)) {
      ASAN_UNPOISON_MEMORY_REGION(block, sizeof(T));
      // Unsized: clang before 19 declares no sized operator delete by
      // default; any delete of memory from `new T` may be unsized.
      ::operator delete(block);
    }
  }

  // A default-initialized T, in the spare block when there is one.
  std::unique_ptr<T> Take() {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__,
                  "an over-aligned T comes from another operator new");
    void* block = slot_.exchange(nullptr, std::memory_order_acquire);
    if (block == nullptr) return std::make_unique_for_overwrite<T>();
    ASAN_UNPOISON_MEMORY_REGION(block, sizeof(T));
    // The block came from `new T` (make_unique_for_overwrite): the
    // unique_ptr's delete frees it with the matching size, like any other.
    return std::unique_ptr<T>(::new (block) T);
  }

  // Destroys `record` here and keeps its memory, unless a block is kept
  // already.
  void Give(std::unique_ptr<T> record) {
    if (record == nullptr) return;
    T* raw = record.release();
    raw->~T();
    // Poisoned before it is published: a Take that finds it unpoisons it.
    ASAN_POISON_MEMORY_REGION(raw, sizeof(T));
    void* empty = nullptr;
    if (!slot_.compare_exchange_strong(empty, raw, std::memory_order_release,
                                       std::memory_order_relaxed)) {
      ASAN_UNPOISON_MEMORY_REGION(raw, sizeof(T));
      ::operator delete(raw);
    }
  }

  // Whether a block is kept (tests).
  bool has_spare() const {
    return slot_.load(std::memory_order_relaxed) != nullptr;
  }

 private:
  std::atomic<void*> slot_{nullptr};
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_SPARE_BLOCK_H_
