#include "transport/rdma/arena_regions.h"

#include <linux/capability.h>
#include <sys/resource.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

// The locked-memory limit in bytes, or nullopt when the process may lock
// any amount (CAP_IPC_LOCK, an unlimited limit).
std::optional<uint64_t> LockLimit() {
  static const bool can_lock_any = [] {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("CapEff:", 0) != 0) continue;
      uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return ((caps >> CAP_IPC_LOCK) & 1) != 0;
    }
    return false;
  }();
  rlimit limit{};
  if (can_lock_any || getrlimit(RLIMIT_MEMLOCK, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY) {
    return std::nullopt;
  }
  return limit.rlim_cur;
}

// Whether pinning the arena in every domain could eat into the
// locked-memory budget that user and large-call registrations need: the
// arena is left out below 1 GiB unless the process may lock any amount.
Status ArenaFitsLockLimit() {
  const std::optional<uint64_t> limit = LockLimit();
  if (!limit || *limit >= (uint64_t{1} << 30)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "the locked-memory limit is ", *limit >> 20,
      " MB: the landing arena is left out below 1 GB, so landings are "
      "registered per call (raise `ulimit -l`, or run with CAP_IPC_LOCK, to "
      "use it)"));
}

// Bytes of the landing arena pinned over all domains: each registration of
// a segment counts against the locked-memory limit, though the pages are
// the same, so together they may take at most half of it and leave the
// rest to user, send and per-call registrations.
std::atomic<uint64_t> arena_pinned{0};
std::atomic<uint64_t> made_in_process{0};

Status ReserveArenaPin(uint64_t bytes) {
  const std::optional<uint64_t> limit = LockLimit();
  if (!limit) {
    arena_pinned.fetch_add(bytes);
    return absl::OkStatus();
  }
  uint64_t pinned = arena_pinned.load();
  do {
    if (pinned + bytes > *limit / 2) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the landing arena is pinned for ", pinned >> 20,
          " MB over all protection domains; one more segment of ", bytes >> 20,
          " MB would pass half the locked-memory limit of ", *limit >> 20,
          " MB, so its landings are registered per call here (raise "
          "`ulimit -l`)"));
    }
  } while (!arena_pinned.compare_exchange_weak(pinned, pinned + bytes));
  return absl::OkStatus();
}

void ReleaseArenaPin(uint64_t bytes) { arena_pinned.fetch_sub(bytes); }

}  // namespace

ArenaRegions::~ArenaRegions() { Drop(nullptr); }

uint64_t ArenaRegions::MadeInProcess() { return made_in_process.load(); }

ibv_mr* ArenaRegions::Find(int segment, const std::shared_ptr<const void>& keep,
                           Status* why) {
  if (ibv_mr* mr = published_[segment].load(std::memory_order_acquire)) {
    return mr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (dropped_) {
    *why = absl::UnavailableError("the landing arena's regions were dropped");
    return nullptr;
  }
  if (mrs_[segment] != nullptr) return mrs_[segment].get();
  if (!unavailable_[segment].ok()) {
    *why = unavailable_[segment];
    return nullptr;
  }
  const uint32_t bit = uint32_t{1} << segment;
  if ((registering_ & bit) == 0) {
    registering_ |= bit;
    RunAside([this, keep, segment] { Register(segment); });
  }
  *why = absl::UnavailableError(
      absl::StrCat("segment ", segment,
                   " of the landing arena is being registered in this "
                   "protection domain"));
  return nullptr;
}

void ArenaRegions::Register(int segment) {
  const LandingArena::Segment memory = LandingArena::Get()->segment(segment);
  const uint32_t bit = uint32_t{1} << segment;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dropped_) {
      registering_ &= ~bit;
      return;
    }
    running_ = true;
  }
  // Under 1 GB of locked memory the arena is left out for good; over the
  // budget, this grant and the next ones in the segment are registered per
  // call, and a later one tries again.
  const Status fits = ArenaFitsLockLimit();
  const bool reserved = fits.ok() && ReserveArenaPin(memory.size).ok();
  // Pinned without mu_ held: it takes long for a large segment.
  StatusOr<MemoryRegion> mr =
      reserved ? RegisterMemory(pd_, memory.base, memory.size,
                                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND)
               : StatusOr<MemoryRegion>(absl::ResourceExhaustedError(""));
  std::unique_lock<std::mutex> lock(mu_);
  registering_ &= ~bit;
  if (dropped_ || !mr.ok()) {
    // A device's refusal stands: that segment's blocks are registered per
    // call in this domain from now on, saying why.
    if (reserved && !mr.ok()) unavailable_[segment] = mr.status();
    if (!fits.ok()) unavailable_[segment] = fits;
    lock.unlock();
    // Before running_ clears: Drop may free the domain once it has.
    if (mr.ok()) mr->reset();
    if (reserved) ReleaseArenaPin(memory.size);
    lock.lock();
  } else {
    published_[segment].store(mr->get(), std::memory_order_release);
    mrs_[segment] = *std::move(mr);
    pinned_ += memory.size;
    made_in_process.fetch_add(1);
  }
  running_ = false;
  registered_cv_.notify_all();
}

void ArenaRegions::Drop(std::shared_ptr<const void> keep) {
  auto mrs = std::make_shared<std::vector<MemoryRegion>>();
  uint64_t pinned = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (dropped_) return;
    dropped_ = true;
    for (auto& published : published_) {
      published.store(nullptr, std::memory_order_relaxed);
    }
    if (keep == nullptr)
      registered_cv_.wait(lock, [this] { return !running_; });
    for (MemoryRegion& mr : mrs_) {
      if (mr != nullptr) mrs->push_back(std::move(mr));
    }
    pinned = std::exchange(pinned_, 0);
  }
  if (mrs->empty()) return;
  if (keep == nullptr) {
    mrs->clear();
    ReleaseArenaPin(pinned);
    return;
  }
  RunAside([mrs, pinned, keep = std::move(keep)] {
    mrs->clear();
    ReleaseArenaPin(pinned);
  });
}

}  // namespace rdmarpc::rdma
