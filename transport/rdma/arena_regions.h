// The landing arena's segments registered in one protection domain, so that
// a domain pins each segment once however many connections grant blocks of
// it: a connection with a domain of its own holds one, and a completion
// group whose members share its domain holds one for all of them.
//
//   ArenaRegions regions(pd);
//   Status why;
//   ibv_mr* mr = regions.Find(segment, keep_alive, &why);
//   if (mr == nullptr) { /* why: being registered, or it cannot be here */ }
//   // bind a window over mr (it lives until Drop or the destructor)
//
// A segment is registered on first use, on the registration thread
// (registration.h), with local write and window binding only: blocks are
// granted through windows bound per grant. Until then, and where it cannot
// be registered (the locked-memory limit), Find says why and the caller
// registers the landing for its call instead. Pinned bytes count against a
// process-wide budget of half the locked-memory limit.
//
// Thread-safe, except that Find must not race Drop (the region it returns
// could be going): a connection calls both under its lock, and a group
// drops its regions once no member is left to find one. Find on a
// registered segment takes no lock.
#ifndef RDMARPC_TRANSPORT_RDMA_ARENA_REGIONS_H_
#define RDMARPC_TRANSPORT_RDMA_ARENA_REGIONS_H_

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "rdmarpc/status.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class ArenaRegions {
 public:
  // Registers in `pd`, which must outlive every registration: until Drop
  // returns, or the destructor, or, for a registration still running
  // aside, until `keep` (Find's) goes.
  explicit ArenaRegions(ibv_pd* pd) : pd_(pd) {}
  ~ArenaRegions();
  ArenaRegions(const ArenaRegions&) = delete;
  ArenaRegions& operator=(const ArenaRegions&) = delete;

  // The registration of arena segment `segment` here, or null with `why`
  // set: UNAVAILABLE while it is being registered (started now if it was
  // not, on the registration thread, which holds `keep` until done: it
  // must keep this object and the domain alive), or why it cannot be.
  ibv_mr* Find(int segment, const std::shared_ptr<const void>& keep,
               Status* why);

  // No more registrations: those made are handed to the registration
  // thread to drop (unpinning takes long), with `keep` holding the domain
  // until then; with a null `keep` they are dropped here, after a
  // registration that is running aside finished (the caller stalls for
  // both: milliseconds per 16 MiB). A registration that finishes later is
  // dropped at once. Every window bound over them must be gone.
  // Idempotent.
  void Drop(std::shared_ptr<const void> keep);

  // Registrations of arena segments made in this process (tests).
  static uint64_t MadeInProcess();

 private:
  void Register(int segment);

  ibv_pd* const pd_;
  // Published once registered: read without mu_.
  std::array<std::atomic<ibv_mr*>, LandingArena::kMaxSegments> published_{};
  std::mutex mu_;
  std::condition_variable registered_cv_;  // a running registration ended
  std::array<MemoryRegion, LandingArena::kMaxSegments> mrs_;
  uint64_t pinned_ = 0;       // their bytes, counted in the budget
  uint32_t registering_ = 0;  // a bit per segment queued or running
  bool running_ = false;      // one is in ibv_reg_mr now
  bool dropped_ = false;
  std::array<Status, LandingArena::kMaxSegments> unavailable_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ARENA_REGIONS_H_
