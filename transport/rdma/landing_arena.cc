#include "transport/rdma/landing_arena.h"

#include <cstdlib>
#include <string>

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
    void* base = std::aligned_alloc(4096, bytes);
    if (base == nullptr) return nullptr;
    return new LandingArena(static_cast<char*>(base), bytes);
  }();
  return arena;
}

std::optional<TensorBuffer> LandingArena::Allocate(size_t size) {
  size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded == 0) rounded = kAlignment;
  std::optional<size_t> offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    offset = fit_.Take(rounded);
  }
  if (!offset) return std::nullopt;
  std::shared_ptr<const void> owner(base_ + *offset,
                                    [this, at = *offset, rounded](const void*) {
                                      std::lock_guard<std::mutex> lock(mu_);
                                      fit_.Give(at, rounded);
                                    });
  return TensorBuffer::Share(std::move(owner), base_ + *offset, size,
                             Device::Host());
}

}  // namespace rdmarpc::rdma
