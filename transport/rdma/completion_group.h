// A completion queue shared by the connections of one engine on one RDMA
// device, and the table that hands each completion to its connection.
//
// A connection joins a group before its queue pair is made (Engine::Join
// picks the engine and the group), and its sends and receives complete on
// the group's queue. Every work request id carries the connection's member
// key (its slot in the group and the slot's generation) in bits
// kKeyShift..62, so the thread that polls the group hands each completion
// to the connection that posted it, and a completion left over from a
// connection that closed never reaches the one that took its slot later.
//
//   RDMARPC_ASSIGN_OR_RETURN(CompletionGroup::Membership member,
//                            Engine::Join(id->verbs, /*serves=*/false, 384));
//   CreateRcQp(id, pd, member.cq(), caps);
//   member.Install(conn);  // conn's completions reach it from now on
//   wr.wr_id = member.key_bits() | local_id;
//
// Threads: one thread polls a group at a time (TryTake .. GiveBack): its
// engine, or a caller that waits for its own call and polls the whole
// group for its spin (Connection::TakeForCaller), completing the calls of
// the group's other connections too. A client's connections and a
// server's join different groups, so a caller never runs a server's
// handler on its own thread.
//
// A client's group is watched by its engine only while something awaits
// a completion there that no caller polls for. The members' calls count
// from their start to their end (AddAwaited .. RemoveAwaited), and so do
// frames and writes queued for the peer's credits (a cancel's), and work
// requests posted until they complete, but for frames with no `sent` (a
// write's, a flush's: Connection::TrackPostedLocked). An engine
// on its way to sleep arms a client group only where something awaits
// and no caller holds it; else it leaves it unarmed and marks it so.
// Whoever then leaves something awaiting unpolled wakes the engine
// (WakeEngineIfUnwatched): a caller that gives the group back, or sleeps
// without having taken it, whoever starts a call no caller polls for, and
// a connection that queues a frame or write, or posts a write, a flush or
// a frame with a `sent`.
// So a thread that makes blocking calls one after another completes each
// on its own thread while the engine sleeps: no arm, no event, no wake-up.
// A completion nothing awaits (a late response to a cancelled call, a
// send's) waits in the queue for the next poll.
//
// A group also holds a protection domain its members share, where the
// device has type-2 memory windows and the process no GPU (SharesDomain):
// a member then grants landing memory only through windows bound to its
// own queue pair, never through a registration for remote write, which
// any queue pair of the domain could use.
//
// Where they share a domain, the members' receives come from one shared
// receive queue too (TakeSharedReceives): a pool of receive buffers that
// backs every member's first receives and grows by chunks as members join;
// a member's peer is granted more credits from the pool's spare receives
// when it runs low (AllotShared, flow_control.h), and its allotment goes
// back to the pool when it leaves. So memory grows with the receives
// peers use, not with connections times their most receives.
//
// Ownership: the engine and every member hold the group. Its queue, domain
// and completion channel go with its last member (Membership's destructor),
// which a connection holds beside its CM id and gives up before it: a
// removed device's context is freed with its last id.
#ifndef RDMARPC_TRANSPORT_RDMA_COMPLETION_GROUP_H_
#define RDMARPC_TRANSPORT_RDMA_COMPLETION_GROUP_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "rdmarpc/status.h"
#include "transport/rdma/arena_regions.h"
#include "transport/rdma/send_pool.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class Connection;
class Engine;

class CompletionGroup : public std::enable_shared_from_this<CompletionGroup> {
 public:
  // Work request ids: bit 63 marks a receive, bits kKeyShift..62 hold the
  // member key (kSlotBits of slot, then its generation), the bits below
  // are the connection's own.
  static constexpr int kKeyShift = 40;
  static constexpr uint64_t kReceiveBit = uint64_t{1} << 63;
  // Receives of the shared queue carry key 0 (no member's: a generation
  // is never 0) and the buffer's index; their completions reach the
  // member by queue pair number.
  static constexpr int kSlotBits = 12;
  static constexpr int kGenerationBits = 63 - kKeyShift - kSlotBits;
  static constexpr uint64_t kLocalMask = (uint64_t{1} << kKeyShift) - 1;
  static constexpr uint32_t kMaxMembers = uint32_t{1} << kSlotBits;
  // Queue entries a group's members may take (fewer if the device allows
  // fewer, more if one connection needs more): a connection of the
  // default configuration takes 384, so about 40 share one queue. The
  // queue has a third more (kSpareDivisor), for completions a member that
  // left may have left behind (a connection that is destroyed without its
  // close being finished by the engine is not drained).
  static constexpr int kDefaultEntries = 16384;
  static constexpr int kSpareDivisor = 3;
  // Completions PollHeld takes at once.
  static constexpr int kPollBatch = 32;
  // The shared receive pool grows by this many buffers, up to
  // kMaxSharedReceives (or the device's limit).
  static constexpr uint32_t kSharedChunkReceives = 64;
  static constexpr uint32_t kMaxSharedReceives = 8192;
  // A group takes no member beyond this many from now on (0: as many as
  // its queue has room for); 1 gives every new connection a queue of its
  // own.
  static void SetMaxMembersForTesting(int members);

  // A connection's place in a group: its slot and its share of the
  // queue's entries. Move-only; destroying it leaves the group, and the
  // last member to leave destroys the queue.
  class Membership {
   public:
    Membership() = default;
    Membership(Membership&& o) noexcept { *this = std::move(o); }
    Membership& operator=(Membership&& o) noexcept;
    ~Membership() { Leave(); }

    explicit operator bool() const { return group_ != nullptr; }
    CompletionGroup* group() const { return group_.get(); }
    ibv_cq* cq() const;
    // Slot and generation; OR-ed into every work request id the member
    // posts as key_bits().
    uint32_t key() const { return key_; }
    uint64_t key_bits() const { return uint64_t{key_} << kKeyShift; }
    // Completions with this member's key go to `conn` from now on (before
    // its first receive is posted), and with shared receives those of its
    // queue pair `qp_num`.
    void Install(Connection* conn, uint32_t qp_num);
    // No completion reaches the installed connection after this returns
    // (it waits while another thread polls the group). Idempotent.
    void Uninstall();

    // Backs `first` receives of `receive_bytes` each for this member's
    // peer from the group's shared receive queue (made with the first
    // such member), growing its pool as needed: the queue for the
    // member's queue pair. Null where the members share no domain, shared
    // receives are off (RDMARPC_RDMA_SHARED_RECEIVES=0), or the queue has
    // buffers of another size or no room left: the member then posts
    // receives of its own. Before Install.
    ibv_srq* TakeSharedReceives(uint32_t receive_bytes, uint32_t first);
    // Up to `want` more receives of the pool's spare for this member's
    // peer; the number allotted (0 when the pool has none spare). Requires
    // the group held.
    uint32_t AllotShared(uint32_t want);
    // The send buffers the group lends its members (send_pool.h), made
    // with the first member that asks, for frames of up to `frame_bytes`.
    // Null where the members share no domain, the pool is off
    // (RDMARPC_RDMA_SEND_POOL_BUFFERS=0), its buffers are smaller, or it
    // could not be registered: the member then registers its own.
    SendPool* TakeSendPool(uint32_t frame_bytes);

   private:
    friend class CompletionGroup;
    void Leave();
    std::shared_ptr<CompletionGroup> group_;
    uint32_t key_ = 0;
    uint32_t entries_ = 0;
    bool shared_receives_ = false;
    uint32_t qp_num_ = 0;  // with shared receives, once installed
  };

  // Makes the queue (and its non-blocking completion channel, watched by
  // `engine`'s `epoll_fd` with the group's address as data) for
  // connections that serve calls (`serves`) or make them. `members`
  // counts the group's members for the engine (incremented by the engine
  // when one joins, decremented here when it leaves).
  static StatusOr<std::shared_ptr<CompletionGroup>> Create(
      Engine* engine, ibv_context* device, bool serves, int entries,
      int epoll_fd, std::atomic<int>* members);
  ~CompletionGroup();
  CompletionGroup(const CompletionGroup&) = delete;
  CompletionGroup& operator=(const CompletionGroup&) = delete;

  // A slot and `entries` queue entries, or false when the group has no
  // room or its queue is gone (the last member left).
  [[nodiscard]] bool TryJoin(uint32_t entries, Membership* member);

  Engine* engine() const { return engine_; }
  ibv_context* device() const { return device_; }
  bool serves() const { return serves_; }
  // The last member left: nothing joins any more, and the queue goes.
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // The queue is gone and its channel no longer watched: no epoll event
  // names the group after the engine's next wait, so it may drop it.
  bool released() const { return released_.load(std::memory_order_acquire); }
  ibv_cq* cq() const { return cq_.get(); }
  // The domain the members share; null where each has its own.
  ibv_pd* pd() const { return pd_.get(); }
  // The landing arena's segments registered in that domain, once for all
  // members; null where each has its own domain. Dropped as the last
  // member leaves, before the domain.
  ArenaRegions* arena_regions() const { return arena_regions_.get(); }

  // The shared receive pool (see TakeSharedReceives): the buffer with
  // `index` (from a receive's work request id), and posting it again.
  // RepostShared requires the group held.
  uint8_t* SharedReceiveBuffer(uint32_t index) const;
  [[nodiscard]] Status RepostShared(uint32_t index);
  // Buffers in the pool (posted, or in a member's hands until posted
  // again).
  uint32_t shared_receive_buffers() const {
    return shared_total_.load(std::memory_order_acquire) -
           static_cast<uint32_t>(
               shared_reposts_failed_.load(std::memory_order_acquire));
  }

  // Polling, one thread at a time. TryTake: false while another thread
  // holds the group, or once it is closed. The engine never waits for a
  // group: finding it held, it comes back on its next pass. (Uninstalling
  // a connection and destroying the queue wait for the holder.)
  bool TryTake();
  // Gives the group back, and wakes its engine if it sleeps with the group
  // unarmed while something awaits (WakeEngineIfUnwatched). Every holder
  // gives back so but the engine's own polls and arms, after which it
  // looks at the group again before it sleeps.
  void GiveBack();
  // Takes the group, waiting for its holder, unless this thread holds it
  // already; true when it took it (then GiveBack). For uninstalling a
  // member, and tearing down one that no engine finished.
  bool TakeBlocking();
  // Polls one batch and hands each completion to its member; the number
  // found. Requires the group held. A failed poll closes every member and
  // marks the group broken.
  int PollHeld();
  // Polls until the queue is found empty (a short batch), at most the
  // queue's size. Requires the group held.
  void DrainHeld();
  // The same right after a member's queue pair was destroyed: installs
  // queued meanwhile wait, so that a later queue pair with the same number
  // is not handed the destroyed one's last shared receives (they go back
  // to the pool).
  void DrainAfterDestroyHeld();
  // The queue failed (a poll error, a CQ error event): nothing joins any
  // more; the members are closed by whoever saw it.
  void MarkBroken() { broken_.store(true, std::memory_order_release); }
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  enum class PollResult { kIdle, kFound, kBusy };
  PollResult TryPoll();
  // Engine, on its way to sleep: requests an event for the group's next
  // completion and polls it once more (what came before the arm raises no
  // event), except in a client group where nothing awaits a completion or
  // a caller holds the group (see above: it stays unarmed, marked so).
  // False when the engine must pass over the group again before it sleeps
  // (it found completions, or someone else holds a server group).
  bool ArmForSleep();

  // Something of a member awaits a completion: a client's call, from its
  // start to its end; a frame or write queued for the peer's credits or a
  // send slot, until it is posted; a posted work request other than a
  // frame with no `sent`, until it completes. Before the post, or under
  // the connection's lock that its completion takes.
  void AddAwaited() { awaited_.fetch_add(1, std::memory_order_seq_cst); }
  void RemoveAwaited(int n = 1) {
    awaited_.fetch_sub(n, std::memory_order_seq_cst);
  }
  // Wakes the engine if it sleeps with the group unarmed while something
  // awaits: after AddAwaited by a thread that will not poll for it, and by
  // a caller that stops polling for its call (GiveBack does it).
  // A thread that holds the group wakes no one: it does when it gives the
  // group back.
  void WakeEngineIfUnwatched();
  // Times the engine armed the group to sleep.
  uint64_t arms() const { return arms_.load(std::memory_order_relaxed); }
  // Whether the engine went to sleep leaving the group unarmed, and no one
  // has woken it for the group since (tests wait for it).
  bool unarmed() const { return unarmed_.load(std::memory_order_seq_cst); }
  // Engine: reads the channel's pending event, unless another thread holds
  // the group (the channel's fd then reports again). Events are
  // acknowledged kEventAckBatch at a time (each acknowledgement takes the
  // queue's mutex in libibverbs), and all before the queue is destroyed.
  void ConsumeEvents();
  static constexpr uint32_t kEventAckBatch = 64;

 private:
  CompletionGroup(Engine* engine, ibv_context* device, bool serves,
                  uint32_t capacity, int epoll_fd, std::atomic<int>* members);
  // A chunk of the shared receive pool: kSharedChunkReceives buffers.
  struct SharedChunk {
    std::unique_ptr<uint8_t[]> bytes;
    MemoryRegion mr;
  };
  void Install(uint32_t key, Connection* conn, uint32_t shared_qp_num);
  void Uninstall(uint32_t key, uint32_t shared_qp_num);
  void Dispatch(const ibv_wc& wc);
  void DispatchShared(const ibv_wc& wc);
  // Applies the shared members Install queued. Requires the group held.
  void TakePendingMembersHeld();
  // Receives of the pool not allotted to any member's peer.
  uint32_t SpareShared(uint32_t allotted) const;
  // Grows the pool aside (once at a time) when a grant found too few
  // spare receives.
  void GrowSharedAside();
  SendPool* TakeSendPool(uint32_t frame_bytes);
  ibv_srq* TakeSharedReceives(uint32_t key, uint32_t receive_bytes,
                              uint32_t first);
  uint32_t AllotShared(uint32_t key, uint32_t want);
  // Adds a chunk to the pool and posts its receives; after a failure (the
  // queue full, a chunk not registered or not posted) none is added any
  // more. Requires mu_.
  [[nodiscard]] Status GrowSharedLocked();
  [[nodiscard]] Status AddSharedChunkLocked();
  [[nodiscard]] Status PostShared(uint32_t index);
  void Leave(uint32_t key, uint32_t entries);
  // Whether this thread holds the group (TryTake).
  bool HeldHere() const;
  // GiveBack for the engine, which looks at the group again before it
  // sleeps.
  void Release();
  // Acknowledges the events read so far. Requires the group held.
  void AckEventsHeld();

  Engine* const engine_;
  ibv_context* const device_;
  const bool serves_;
  const uint32_t capacity_;  // queue entries
  const int epoll_fd_;
  std::atomic<int>* const engine_members_;
  std::atomic<bool> polling_{false};
  // How many of the members' calls, frames and writes await a completion,
  // and whether the engine last went to sleep without arming the group
  // (cleared by whoever arms it or wakes the engine for it). Sequentially
  // consistent with polling_: a thread stores one and loads the other, so
  // of two racing threads at least one sees the other's store.
  std::atomic<int> awaited_{0};
  std::atomic<bool> unarmed_{false};
  std::atomic<uint64_t> arms_{0};
  std::atomic<bool> closed_{false};
  std::atomic<bool> released_{false};
  std::atomic<bool> broken_{false};
  // Written only with polling_ held (or before the first member joins).
  CompletionChannel channel_;
  CompletionQueue cq_;
  uint32_t unacked_events_ = 0;  // read from channel_, not acknowledged
  ProtectionDomain pd_;          // see pd(); goes with the queue
  std::unique_ptr<ArenaRegions> arena_regions_;  // in pd_, made with it
  // In pd_, made under mu_ by the first TakeSendPool, which hands it out
  // under mu_; never replaced, and goes with the queue.
  std::unique_ptr<SendPool> send_pool_;
  bool send_pool_tried_ = false;
  // Per slot: the installed connection (its key says whether a
  // completion is its own). Read by the polling thread; cleared with
  // polling_ held, so no completion is being handed to it then.
  std::unique_ptr<std::atomic<Connection*>[]> slots_;
  // Membership, under mu_.
  std::mutex mu_;
  uint32_t members_ = 0;
  uint32_t entries_taken_ = 0;
  std::vector<uint32_t> free_slots_;
  uint32_t next_unused_slot_ = 0;
  std::vector<uint32_t> generations_;  // per slot
  // The thread-local group the holder held before this one (restored by
  // GiveBack).
  const CompletionGroup* held_before_ = nullptr;

  // Shared receives. The queue, its buffer size and the chunks' owners
  // change under mu_ (until the last member leaves); chunk pointers are
  // published to the polling thread through shared_chunks_.
  SharedReceiveQueue srq_;
  uint32_t srq_receive_bytes_ = 0;
  uint32_t srq_capacity_ = 0;
  std::vector<std::unique_ptr<SharedChunk>> owned_chunks_;
  std::unique_ptr<std::atomic<SharedChunk*>[]> shared_chunks_;
  // Where the next chunk goes (its buffers' indexes start at this times
  // kSharedChunkReceives); under mu_.
  uint32_t next_chunk_ = 0;
  std::atomic<bool> growing_aside_{false};
  // Buffers in the pool (grows under mu_), and the receives members'
  // peers are allotted (never more than the pool's buffers); per slot,
  // the member's share, given back when it leaves.
  std::atomic<uint32_t> shared_total_{0};
  std::atomic<uint32_t> shared_allotted_{0};
  std::unique_ptr<std::atomic<uint32_t>[]> slot_allotted_;
  // Queue pair number to member, for shared receives' completions. Read
  // and changed only with the group held; Install queues its entries in
  // pending_members_ (under mu_, flagged by members_pending_) for the
  // holder to take, so that it never waits for the group.
  std::unordered_map<uint32_t, Connection*> shared_members_;
  std::mutex pending_mu_;  // guards pending_members_
  std::vector<std::pair<uint32_t, Connection*>> pending_members_;
  std::atomic<bool> members_pending_{false};
  bool installs_held_ = false;  // the holder's: DrainAfterDestroyHeld
  // No more chunks: the queue is full, or a chunk failed to register or
  // post.
  std::atomic<bool> shared_growth_over_{false};
  // Shared receives that could not be posted (again): the pool is
  // smaller by as many, and allots none against them.
  std::atomic<uint64_t> shared_reposts_failed_{0};
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_COMPLETION_GROUP_H_
