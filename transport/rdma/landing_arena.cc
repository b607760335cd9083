#include "transport/rdma/landing_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace rdmarpc::rdma {

LandingArena* LandingArena::Get() {
  static LandingArena* arena = []() -> LandingArena* {
    size_t bytes = size_t{16} << 20;
    if (const char* env = std::getenv("RDMARPC_RDMA_LANDING_ARENA_BYTES");
        env != nullptr && *env != '\0') {
      bytes = std::strtoull(env, nullptr, 10);
    }
    bytes = (bytes + 4095) / 4096 * 4096;
    if (bytes == 0) return nullptr;
    // Mapped afresh, so it starts zeroed (see Allocate).
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    return new LandingArena(static_cast<char*>(base), bytes);
  }();
  return arena;
}

std::optional<TensorBuffer> LandingArena::Allocate(size_t size) {
  const size_t rounded = std::max(Rounded(size), kAlignment);
  std::optional<size_t> offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    offset = fit_.Take(rounded);
  }
  if (!offset) return std::nullopt;
  std::shared_ptr<const void> owner(base_ + *offset,
                                    [this, at = *offset, rounded](const void*) {
                                      // Zeroed for the next call (header).
                                      std::memset(base_ + at, 0, rounded);
                                      std::lock_guard<std::mutex> lock(mu_);
                                      fit_.Give(at, rounded);
                                    });
  return TensorBuffer::Share(std::move(owner), base_ + *offset, size,
                             Device::Host());
}

}  // namespace rdmarpc::rdma
