// Host landing memory set aside once per process, so that a small call's
// landing costs neither an allocation nor a registration of its own: each
// connection registers the whole arena once, on first use and off the
// thread that polls it, and grants blocks of it through memory windows
// bound per grant (Connection::GrantWindow), so a peer still writes only
// into the blocks its open grants name.
//
//   LandingArena* arena = LandingArena::Get();  // null: turned off
//   std::optional<TensorBuffer> block = arena->Allocate(4096);
//   // nullopt: full, land in memory of the call's own instead
//   // the block returns when its last TensorBuffer goes
//
// Every block reads as zero where no peer wrote: the arena starts zeroed
// and a block is cleared when it returns, so a peer that writes less than
// its grant never shows the reader an earlier call's bytes.
//
// Thread-safe.
#ifndef RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_
#define RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_

#include <cstddef>
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

  // The process's arena, created on first use and never destroyed (landed
  // tensors may outlive everything else): RDMARPC_RDMA_LANDING_ARENA_BYTES
  // bytes, 16 MiB by default; 0 turns it off (null).
  static LandingArena* Get();

  void* base() const { return base_; }
  size_t size() const { return size_; }

  // A block of `size` bytes, or nullopt when no free block is that large.
  std::optional<TensorBuffer> Allocate(size_t size);

 private:
  LandingArena(char* base, size_t size)
      : base_(base), size_(size), fit_(size) {}

  char* const base_;
  const size_t size_;
  std::mutex mu_;
  internal::FirstFit fit_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_LANDING_ARENA_H_
