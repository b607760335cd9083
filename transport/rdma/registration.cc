#include "transport/rdma/registration.h"

#include <unistd.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rdmarpc/memory.h"
#include "runtime/thread_pool.h"

namespace rdmarpc {
namespace rdma {
namespace {

struct Range {
  uintptr_t base;  // page-aligned
  size_t size;     // whole pages
};

// The ranges the user registered, and the caches that hold registrations
// of them.
class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();
    return *registry;
  }

  Status Add(const void* data, size_t size) {
    if (data == nullptr || size == 0) {
      return absl::InvalidArgumentError("RegisterMemoryForRdma: empty range");
    }
    uintptr_t start = reinterpret_cast<uintptr_t>(data);
    if (start + size < start) {
      return absl::InvalidArgumentError(
          "RegisterMemoryForRdma: the range wraps around");
    }
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    uintptr_t base = start & ~(page - 1);
    uintptr_t end = (start + size + page - 1) & ~(page - 1);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = ranges_.lower_bound(start);
    if (next != ranges_.end() && next->second.base < end) return Overlap();
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second.base + prev->second.size > base) return Overlap();
    }
    ranges_.emplace(start, Range{base, end - base});
    return absl::OkStatus();
  }

  Status Remove(const void* data) {
    uintptr_t start = reinterpret_cast<uintptr_t>(data);
    Range range;
    std::vector<std::shared_ptr<RegistrationCache>> caches;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ranges_.find(start);
      if (it == ranges_.end()) {
        return absl::NotFoundError(
            "UnregisterMemoryForRdma: no range registered at this address");
      }
      range = it->second;
      ranges_.erase(it);
      for (auto c = caches_.begin(); c != caches_.end();) {
        if (auto live = c->lock()) {
          caches.push_back(std::move(live));
          ++c;
        } else {
          c = caches_.erase(c);
        }
      }
    }
    for (auto& cache : caches) cache->Drop(range.base);
    return absl::OkStatus();
  }

  // The registered range holding [addr, addr + size), if any.
  bool Find(uintptr_t addr, size_t size, Range* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(addr);
    if (it == ranges_.begin()) return false;
    --it;
    const Range& r = it->second;
    if (addr < r.base || addr + size > r.base + r.size) return false;
    *out = r;
    return true;
  }

  void Track(const std::shared_ptr<RegistrationCache>& cache) {
    std::lock_guard<std::mutex> lock(mu_);
    caches_.push_back(cache);
  }

 private:
  static Status Overlap() {
    return absl::InvalidArgumentError(
        "RegisterMemoryForRdma: the range overlaps a registered range "
        "(whole pages count); unregister that one first");
  }

  std::mutex mu_;
  std::map<uintptr_t, Range> ranges_;  // by the address the user gave
  std::vector<std::weak_ptr<RegistrationCache>> caches_;
};

}  // namespace

std::shared_ptr<RegistrationCache> RegistrationCache::Create(ibv_pd* pd) {
  std::shared_ptr<RegistrationCache> cache(new RegistrationCache(pd));
  Registry::Get().Track(cache);
  return cache;
}

RegistrationCache::~RegistrationCache() = default;

StatusOr<LocalMemory> RegistrationCache::ForSend(const void* addr,
                                                 size_t size) {
  uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  Range range;
  if (Registry::Get().Find(start, size, &range)) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_base_.find(range.base);
    if (it == by_base_.end()) {
      misses_.fetch_add(1);
      RDMARPC_ASSIGN_OR_RETURN(
          MemoryRegion mr,
          RegisterMemory(pd_, reinterpret_cast<void*>(range.base), range.size,
                         0));
      it = by_base_
               .emplace(range.base,
                        std::make_shared<MemoryRegion>(std::move(mr)))
               .first;
    } else {
      hits_.fetch_add(1);
    }
    return LocalMemory{(*it->second)->lkey, it->second, true};
  }
  // Not registered by the user: register exactly what this call reads.
  RDMARPC_ASSIGN_OR_RETURN(
      MemoryRegion mr, RegisterMemory(pd_, const_cast<void*>(addr), size, 0));
  auto shared = std::make_shared<MemoryRegion>(std::move(mr));
  return LocalMemory{(*shared)->lkey, shared, false};
}

void RegistrationCache::Drop(uintptr_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_.erase(base);
}

void RegistrationCache::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_.clear();
}

StatusOr<MemoryRegion> RegisterLanding(ibv_pd* pd, void* addr, size_t size,
                                       LandingAccess access) {
  return RegisterMemory(
      pd, addr, size,
      IBV_ACCESS_LOCAL_WRITE |
          (access == LandingAccess::kWindow ? IBV_ACCESS_MW_BIND
                                            : IBV_ACCESS_REMOTE_WRITE));
}

void RunAside(std::function<void()> task) {
  // Never destroyed: regions may be dropped during static destruction.
  static internal::ThreadPool* pool =
      new internal::ThreadPool(1, "rdmarpc-reg");
  pool->Post(std::move(task));
}

void DeregisterAside(std::vector<MemoryRegion> mrs,
                     std::shared_ptr<const void> pd_owner) {
  if (mrs.empty()) return;
  RunAside([mrs = std::make_shared<std::vector<MemoryRegion>>(std::move(mrs)),
            pd_owner = std::move(pd_owner)]() mutable {
    mrs->clear();  // before the domain's owner goes
    pd_owner.reset();
  });
}

}  // namespace rdma

Status RegisterMemoryForRdma(const void* data, size_t size) {
  return rdma::Registry::Get().Add(data, size);
}

Status UnregisterMemoryForRdma(const void* data) {
  return rdma::Registry::Get().Remove(data);
}

}  // namespace rdmarpc
