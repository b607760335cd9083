// Host landing memory set aside per process, so that a call's landing costs
// neither an allocation nor a registration of its own: each connection
// registers the arena's segments once, off the thread that polls it, and
// grants blocks of them through memory windows bound per grant
// (Connection::BindArenaWindow), so a peer still writes only into the blocks
// its open grants name.
//
//   LandingArena* arena = LandingArena::Get();  // null: turned off
//   std::optional<TensorBuffer> block = arena->Allocate(4096);
//   // nullopt: full at its limit, land in memory of the call's own instead
//   // the block returns when its last TensorBuffer goes
//
// The arena starts with one segment and grows by another when a block does
// not fit, up to its limit: a new segment is only mapped here (pages are
// faulted in and pinned by the connections' registrations, aside), so
// growing costs the thread that asks one system call. The first call that
// lands in a new segment on a connection is registered per call while the
// connection registers that segment. Segments are never unmapped: landed
// tensors may outlive everything else.
//
// Every block reads as zero where no peer wrote: segments start zeroed and
// a block is cleared when it returns (a block of kClearAsideBytes or more
// on the registration thread, since clearing it takes milliseconds), so a
// peer that writes less than its grant never shows the reader an earlier
// call's bytes.
//
// Thread-safe.
#ifndef RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_
#define RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>

#include "rdmarpc/memory.h"
#include "runtime/first_fit.h"

namespace rdmarpc::rdma {

class LandingArena {
 public:
  // Blocks are aligned to this many bytes, and so is each part placed in
  // one (payload.cc).
  static constexpr size_t kAlignment = 64;
  // `size` rounded up to kAlignment: the room a part takes in a block.
  static constexpr size_t Rounded(size_t size) {
    return (size + kAlignment - 1) / kAlignment * kAlignment;
  }
  // Segments an arena grows to at most (each at least doubles the arena).
  static constexpr int kMaxSegments = 8;
  // Blocks this large or larger are cleared on the registration thread.
  static constexpr size_t kClearAsideBytes = size_t{1} << 20;
  // The default limit the arena grows to
  // (RDMARPC_RDMA_LANDING_ARENA_MAX_BYTES).
  static constexpr size_t kDefaultLimitBytes = size_t{256} << 20;

  // The process's arena, created on first use and never destroyed (landed
  // tensors may outlive everything else): it starts with
  // RDMARPC_RDMA_LANDING_ARENA_BYTES bytes (16 MiB by default; 0 turns the
  // arena off: null) and grows up to RDMARPC_RDMA_LANDING_ARENA_MAX_BYTES
  // (256 MiB by default, never below the first segment).
  static LandingArena* Get();

  // An arena of its own, for tests: segments of `first_bytes` and more, up
  // to `limit_bytes` in all. Blocks clear on the thread that drops them
  // unless `clear_large_aside`. Must outlive its blocks. Null if the first
  // segment cannot be mapped.
  static std::unique_ptr<LandingArena> CreateForTesting(size_t first_bytes,
                                                        size_t limit_bytes,
                                                        bool clear_large_aside);
  ~LandingArena();

  struct Segment {
    char* base = nullptr;
    size_t size = 0;
  };
  // Segments mapped so far; segment(i) for i below it never changes.
  int segments() const { return segments_.load(std::memory_order_acquire); }
  Segment segment(int index) const;
  // The segment holding `at`, or -1.
  int SegmentOf(const void* at) const;
  // Bytes mapped so far, and the most the arena may map.
  size_t mapped_bytes() const;
  size_t limit_bytes() const { return limit_; }

  // A block of `size` bytes, or nullopt when no segment has room and the
  // arena cannot grow by one that would.
  std::optional<TensorBuffer> Allocate(size_t size);

 private:
  struct Slot {
    Segment memory;
    std::unique_ptr<internal::FirstFit> fit;  // guarded by mu_
  };

  LandingArena(size_t limit, bool clear_large_aside)
      : limit_(limit), clear_large_aside_(clear_large_aside) {}
  // Maps a segment of `bytes` (page-rounded) and publishes it. Requires mu_.
  bool MapSegmentLocked(size_t bytes);
  // Clears a returned block and gives it back to its segment.
  void Return(int segment, size_t offset, size_t size);

  const size_t limit_;
  const bool clear_large_aside_;
  mutable std::mutex mu_;
  std::array<Slot, kMaxSegments> slots_;
  size_t mapped_ = 0;  // guarded by mu_
  std::atomic<int> segments_{0};
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_
