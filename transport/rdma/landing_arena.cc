#include "transport/rdma/landing_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

constexpr size_t kPageBytes = 4096;

size_t PageRounded(size_t bytes) {
  return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

// At most 1 TiB, so that rounding up cannot wrap.
size_t BytesFromEnv(const char* name, size_t otherwise) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return otherwise;
  return std::min<size_t>(std::strtoull(env, nullptr, 10), size_t{1} << 40);
}

}  // namespace

LandingArena* LandingArena::Get() {
  static LandingArena* arena = []() -> LandingArena* {
    const size_t first = PageRounded(
        BytesFromEnv("RDMARPC_RDMA_LANDING_ARENA_BYTES", size_t{16} << 20));
    if (first == 0) return nullptr;
    const size_t limit = std::max(
        first, PageRounded(BytesFromEnv("RDMARPC_RDMA_LANDING_ARENA_MAX_BYTES",
                                        kDefaultLimitBytes)));
    std::unique_ptr<LandingArena> made(
        new LandingArena(limit, /*clear_large_aside=*/true));
    {
      std::lock_guard<std::mutex> lock(made->mu_);
      if (!made->MapSegmentLocked(first)) return nullptr;
    }
    return made.release();
  }();
  return arena;
}

std::unique_ptr<LandingArena> LandingArena::CreateForTesting(
    size_t first_bytes, size_t limit_bytes, bool clear_large_aside) {
  std::unique_ptr<LandingArena> made(new LandingArena(
      std::max(PageRounded(first_bytes), PageRounded(limit_bytes)),
      clear_large_aside));
  {
    std::lock_guard<std::mutex> lock(made->mu_);
    if (!made->MapSegmentLocked(first_bytes)) return nullptr;
  }
  return made;
}

LandingArena::~LandingArena() {
  for (int i = 0; i < segments(); ++i) {
    munmap(slots_[i].memory.base, slots_[i].memory.size);
  }
}

LandingArena::Segment LandingArena::segment(int index) const {
  return slots_[index].memory;
}

int LandingArena::SegmentOf(const void* at) const {
  const auto* p = static_cast<const char*>(at);
  for (int i = 0; i < segments(); ++i) {
    const Segment& s = slots_[i].memory;
    if (p >= s.base && p < s.base + s.size) return i;
  }
  return -1;
}

size_t LandingArena::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}

bool LandingArena::MapSegmentLocked(size_t bytes) {
  const int index = segments_.load(std::memory_order_relaxed);
  bytes = PageRounded(bytes);
  if (index >= kMaxSegments || bytes == 0 || mapped_ + bytes > limit_) {
    return false;
  }
  // Mapped afresh, so it starts zeroed (see Allocate).
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return false;
  slots_[index].memory = {static_cast<char*>(base), bytes};
  slots_[index].fit = std::make_unique<internal::FirstFit>(bytes);
  mapped_ += bytes;
  segments_.store(index + 1, std::memory_order_release);
  return true;
}

std::optional<TensorBuffer> LandingArena::Allocate(size_t size) {
  const size_t rounded = std::max(Rounded(size), kAlignment);
  int segment = -1;
  std::optional<size_t> offset;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int count = segments_.load(std::memory_order_relaxed);
    for (int i = 0; i < count && !offset; ++i) {
      offset = slots_[i].fit->Take(rounded);
      segment = i;
    }
    // Grows by at least the arena's size so far, so that a few segments
    // cover the limit; by less only where the limit leaves less.
    if (!offset && limit_ - mapped_ >= rounded &&
        MapSegmentLocked(
            std::min(std::max(rounded, mapped_), limit_ - mapped_))) {
      segment = count;
      offset = slots_[segment].fit->Take(rounded);
    }
  }
  if (!offset) return std::nullopt;
  char* data = slots_[segment].memory.base + *offset;
  std::shared_ptr<const void> owner(
      data, [this, segment, at = *offset, rounded](const void*) {
        Return(segment, at, rounded);
      });
  return TensorBuffer::Share(std::move(owner), data, size, Device::Host());
}

void LandingArena::Return(int segment, size_t offset, size_t size) {
  auto clear_and_give = [this, segment, offset, size] {
    // Zeroed for the next call (header).
    std::memset(slots_[segment].memory.base + offset, 0, size);
    std::lock_guard<std::mutex> lock(mu_);
    slots_[segment].fit->Give(offset, size);
  };
  if (clear_large_aside_ && size >= kClearAsideBytes) {
    RunAside(std::move(clear_and_give));
  } else {
    clear_and_give();
  }
}

}  // namespace rdmarpc::rdma
