// Memory registrations for the RDMA transport.
//
// Local memory a write reads from needs an lkey in the connection's
// protection domain. Ranges the user registered (RegisterMemoryForRdma in
// rdmarpc/memory.h) are registered once per connection and cached; any
// other buffer is registered for one call and released with it. Landing
// memory is registered per grant with remote-write access only (or granted
// through a memory window over the pre-registered landing arena:
// landing_arena.h), and the access ends with the grant, so a peer
// can write only where a call of its own connection is expecting bytes,
// and only while it is.
//
//   RegistrationCache cache(conn->pd());
//   RDMARPC_ASSIGN_OR_RETURN(LocalMemory src, cache.ForSend(ptr, n));
//   conn->Write({.local = ptr, .lkey = src.lkey, ...}, ...);
//   // keep `src` until the write's continuation ran
#ifndef RDMARPC_TRANSPORT_RDMA_REGISTRATION_H_
#define RDMARPC_TRANSPORT_RDMA_REGISTRATION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "rdmarpc/status.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

// A registration that one work request uses; shares the memory region.
struct LocalMemory {
  uint32_t lkey = 0;
  std::shared_ptr<MemoryRegion> mr;
  bool cached = false;  // from a user-registered range
};

class RegistrationCache
    : public std::enable_shared_from_this<RegistrationCache> {
 public:
  // Joins the process-wide list so UnregisterMemoryForRdma reaches it.
  static std::shared_ptr<RegistrationCache> Create(ibv_pd* pd);
  ~RegistrationCache();

  // An lkey covering [addr, addr + size): the cached registration of the
  // user-registered range that holds it, or a new one for this use only.
  [[nodiscard]] StatusOr<LocalMemory> ForSend(const void* addr, size_t size);

  // Drops every registration (before the protection domain goes).
  void Clear();

  uint64_t hits() const { return hits_.load(); }
  uint64_t misses() const { return misses_.load(); }

  // Registry use: forget the range starting at `base`.
  void Drop(uintptr_t base);

 private:
  explicit RegistrationCache(ibv_pd* pd) : pd_(pd) {}

  ibv_pd* pd_;
  std::mutex mu_;
  std::map<uintptr_t, std::shared_ptr<MemoryRegion>> by_base_;
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
};

// How landing memory for one grant is reached by the peer.
enum class LandingAccess {
  kRemoteWrite,  // through the region's own rkey
  kWindow,       // only through a memory window bound over it
};
// Registers landing memory for one grant: local write, and remote write
// or window binding.
[[nodiscard]] StatusOr<MemoryRegion> RegisterLanding(ibv_pd* pd, void* addr,
                                                     size_t size,
                                                     LandingAccess access);

// Registering, deregistering or freeing this many bytes or more pins,
// unpins or unmaps every page (hundreds of milliseconds per GiB): too slow
// for a thread that polls completions for other connections. Such work runs
// aside, on the process's registration thread.
inline constexpr uint64_t kRegisterAsideBytes = uint64_t{1} << 20;

// Runs `task` on the registration thread ("rdmarpc-reg"), in FIFO order.
void RunAside(std::function<void()> task);

// Deregisters `mrs` on the registration thread. `pd_owner` keeps their
// protection domain until then (a region must go before its domain).
void DeregisterAside(std::vector<MemoryRegion> mrs,
                     std::shared_ptr<const void> pd_owner);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_REGISTRATION_H_
