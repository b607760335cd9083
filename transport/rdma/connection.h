// One RDMA connection's datapath: a reliable-connected queue pair, its
// control buffers, its credit window and the queue of work that waits for
// credits.
//
// Frames (wire.h) go by SEND from registered send buffers into the peer's
// pre-posted control receives; tensor bytes go by RDMA WRITE from the
// caller's registered memory into regions the peer granted. Both queue here
// and are posted only when CreditWindow says a peer receive and a send slot
// are free, so no post ever fails for lack of either.
//
//   auto conn = Connection::Create(std::move(resources), config, handler);
//   Engine::Add(conn);             // its engine finishes its close
//   conn->SendFrame(FrameType::kRequest, &head, inline_parts);
//   conn->Write({.local = ..., .lkey = ..., .remote_addr = ...,
//                .rkey = ..., .length = ..., .immediate = grant_id},
//               [](Status s) { /* bytes left our memory, or failed */ });
//
// Threads: SendFrame, Write and Close may be called from any thread. The
// Handler's methods and every Write continuation run on the thread that
// polls the connection's completion group, one at a time: the engine, or
// a caller waiting for a call on this or another connection of the group
// (Channel::Call, through TakeForCaller). They run
// without the connection's lock held, so they may call back in. A frame
// with a `sent` continuation queued by the polling thread itself goes
// unsignaled like the others: its `sent` runs once a later completion
// covers it, at the latest when the engine flushes before it sleeps
// (FlushUnsignaled). Large
// writes on a software device are posted by one process-wide poster thread
// (ConnectionConfig::post_aside_bytes); their continuations still run on the
// polling thread.
// Setup (connection_setup.cc) builds the verbs objects; this file only moves
// bytes.
#ifndef RDMARPC_TRANSPORT_RDMA_CONNECTION_H_
#define RDMARPC_TRANSPORT_RDMA_CONNECTION_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "google/protobuf/message_lite.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "runtime/completion.h"
#include "runtime/transport.h"
#include "transport/rdma/arena_regions.h"
#include "transport/rdma/completion_group.h"
#include "transport/rdma/flow_control.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/send_pool.h"
#include "transport/rdma/verbs.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

// Memory windows per connection for grants of landing memory (blocks of
// the landing arena, landing_arena.h, or regions registered for one
// grant), and the send-queue room their binds and
// invalidations take beside ConnectionConfig::send_queue_slots: a window
// has at most one bind and one invalidation outstanding.
inline constexpr uint32_t kLandingWindows = 32;
inline constexpr uint32_t kWindowWorkRequests = 2 * kLandingWindows;

// The credits a side starts with (its first receives) where the peer may
// back up to `receives`: more are granted when it runs low (flow_control.h).
inline constexpr uint32_t kFirstReceives = 16;
inline uint32_t FirstReceives(uint32_t receives) {
  return receives < kFirstReceives ? receives : kFirstReceives;
}

// Sizes both sides agree on in the handshake.
struct ConnectionConfig {
  // The most control receives we back for the peer (its credits), and
  // how many it starts with (0: all of them); the rest are granted when
  // it runs low.
  uint32_t receives = 64;
  uint32_t first_receives = 0;
  uint32_t receive_bytes = 32 << 10;  // size of each
  uint32_t send_queue_slots = 256;    // max_send_wr
  // The same of the peer's, for us: peer_receives also counts our send
  // buffers.
  uint32_t peer_receives = 64;
  uint32_t peer_first_receives = 0;
  uint32_t peer_receive_bytes = 32 << 10;
  // Writes larger than this are split (the device's max_msg_sz, or less):
  // each piece's completion tells the progress watch that a large
  // transfer moves, where one 1 GiB piece stays silent until its end.
  uint64_t max_write_bytes = uint64_t{64} << 20;
  // Writes of at least this many bytes are posted by the process's poster
  // thread, not the polling one (0: never). Set on software devices (rxe,
  // siw), whose ibv_post_send moves the bytes before it returns: a 1 GiB
  // write posted by the engine would hold every connection it polls.
  uint64_t post_aside_bytes = 0;
  // Frames go unsignaled (no completion of their own) while fewer than
  // this many unsignaled ones are outstanding: a later signaled work
  // request's completion releases them, as a reliable connection completes
  // its sends in order. 0: min(16, peer_receives / 2, send_queue_slots /
  // 4); 1: every frame is signaled.
  uint32_t signal_interval = 0;
};

// Send buffers come in chunks of this many (up to the peer's receives): the
// first with the connection, the rest registered aside when frames find
// none free. Where the connection's group lends send buffers (send_pool.h),
// frames borrow them (each signaled, so it comes back when sent) and the
// first chunk is registered aside once kBorrowedFramesBeforeOwn frames
// went through the pool, or a frame found it empty: a connection that
// sends little holds no send buffers of its own.
inline constexpr uint32_t kSendChunkBuffers = kFirstReceives;
inline constexpr uint64_t kBorrowedFramesBeforeOwn = 256;
inline uint32_t FirstSendBuffers(uint32_t peer_receives) {
  return peer_receives < kSendChunkBuffers ? peer_receives : kSendChunkBuffers;
}

// A chunk of send buffers beyond the first (ConnectionResources).
struct SendChunk {
  std::unique_ptr<uint8_t[]> bytes;
  MemoryRegion mr;
};

// The verbs objects of one connection, in creation order (so destruction
// runs in reverse). Built by connection_setup.cc.
struct ConnectionResources {
  // First, so they are freed after the queue pair and their registrations.
  std::unique_ptr<uint8_t[]> receive_buffers;
  std::unique_ptr<uint8_t[]> send_buffers;
  // The id's event channel: a client's own, or the server listener's
  // (shared, so it stays open until this id is destroyed).
  SharedEventChannel events;
  CmId id;
  // The connection's own protection domain, where it does not share its
  // group's (CompletionGroup::pd).
  ProtectionDomain own_pd;
  // The completion queue the queue pair shares with the other connections
  // of its engine on this device, and their domain where they share one.
  // Left after the queue pair and the regions are destroyed and before
  // the id (the last member destroys the queue and the domain).
  CompletionGroup::Membership group;
  ibv_pd* pd = nullptr;  // own_pd's or the group's
  // The group's shared receive queue where the connection's receives come
  // from it (receive_buffers and receive_mr are then empty).
  ibv_srq* srq = nullptr;
  MemoryRegion receive_mr;
  // The group's send buffers that frames borrow until the connection has
  // its own (send_pool.h); null where the group lends none.
  SendPool* send_pool = nullptr;
  // The first chunk of send buffers (send_buffers): made here where no
  // pool lends, else by the connection once it needs its own.
  MemoryRegion send_mr;
  // The other chunks, added by Connection (under its lock) as frames need
  // them; after the queue pair goes, before the domain.
  std::vector<SendChunk> more_sends;
  CmQueuePair qp;
};

class Engine;

class Connection : public std::enable_shared_from_this<Connection>,
                   public internal::CallerPoll {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    // A frame the peer sent. `frame` points into a receive buffer that is
    // re-posted when this returns: copy what must outlive the call. An
    // error closes the connection (a peer that broke the protocol).
    virtual Status OnFrame(const FrameView& frame) = 0;
    // The peer's WRITE WITH IMMEDIATE carrying `immediate` has landed.
    virtual Status OnWriteLanded(uint32_t immediate) = 0;
    // Runs exactly once, after which nothing else is called.
    virtual void OnClosed(const Status& why) = 0;
  };

  struct WriteRequest {
    const void* local = nullptr;
    uint32_t lkey = 0;
    uint64_t remote_addr = 0;
    uint32_t rkey = 0;
    uint64_t length = 0;
    // Set: the last piece is a WRITE WITH IMMEDIATE carrying this value.
    std::optional<uint32_t> immediate;
    // Runs when a piece before the last completes (on the polling thread,
    // without the connection's lock): the write moves.
    std::function<void()> on_piece;
  };

  // Posts the receives. `resources.qp` must exist. Its completions are
  // handled from now on, by whoever polls its group; Engine::Add(it) then
  // makes its engine finish its close.
  static StatusOr<std::shared_ptr<Connection>> Create(
      ConnectionResources resources, const ConnectionConfig& config,
      std::shared_ptr<Handler> handler);
  ~Connection();

  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Queues a frame (its bytes are copied now; `message`, if any, is
  // serialized now, before `inline_parts`). UNAVAILABLE once the
  // connection is closed; RESOURCE_EXHAUSTED if it does not fit the peer's
  // receive buffers. `sent`, if given, runs once on the polling thread: OK
  // when the frame reached the peer's receive (RC acknowledged), else the
  // error that closed the connection; never when this returns an error,
  // and then `sent` is left as it was (taken only on success, so the
  // caller can still run it without a copy).
  [[nodiscard]] Status SendFrame(
      FrameType type, const FrameHead& head,
      std::span<const std::span<const uint8_t>> inline_parts = {},
      std::function<void(Status)>&& sent = nullptr, MessagePart message = {});

  // Queues a write. `done` runs once on the polling thread when every piece
  // completed (OK) or the connection failed (the error); the memory at
  // `local` is borrowed until then. Returns an error (and never runs
  // `done`) when the connection is already closed.
  [[nodiscard]] Status Write(const WriteRequest& request,
                             std::function<void(Status)> done);

  // Closes the connection (any thread, any number of times; the first
  // wins): the peer is told, queued and posted work fails with `why`,
  // Handler::OnClosed runs. `trigger` names the cause in a few words for
  // the channel's health report ("work-completion error", "port error").
  void Close(Status why, const char* trigger = "connection closed");
  // The first Close's trigger.
  std::string close_trigger() const;
  bool closed() const { return closed_.load(); }
  // Whether a malformed frame or a Handler error closed it.
  bool broke_protocol() const { return broke_protocol_.load(); }
  // When the last frame or write from the peer arrived (steady clock).
  std::chrono::steady_clock::time_point last_heard() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_heard_.load()));
  }
  // Fault injection: moves the queue pair to the error state, as a fatal
  // device error would; posted work then completes with flush errors.
  Status InjectQueuePairError();

  // Bytes a frame may take at most (the peer's receive size).
  size_t max_frame_bytes() const { return config_.peer_receive_bytes; }
  // Bytes a frame from the peer may take (this side's receive size).
  size_t receive_bytes() const { return config_.receive_bytes; }
  ibv_pd* pd() const { return res_.pd; }
  // Whether other connections share pd(): landing memory is then granted
  // only through this connection's windows, never registered for remote
  // write.
  bool shares_domain() const { return res_.own_pd == nullptr; }
  // FinishClose has run: the queue pair is gone.
  bool finished() const { return finished_.load(std::memory_order_relaxed); }
  // The device's IBV_EVENT_QP_LAST_WQE_REACHED for this connection's queue
  // pair: it takes no more shared receives (Engine's async events).
  void NoteLastSharedReceive();
  // Closes that destroyed their queue pair without that event, having
  // waited for it as long as they wait (process-wide, for tests).
  static uint64_t LastSharedReceiveWaitsTimedOut();
  // Whether its receives come from its group's shared receive queue, and
  // the buffers of that queue's pool (0 without).
  bool shares_receives() const { return res_.srq != nullptr; }
  uint32_t shared_receive_buffers() const {
    return res_.srq == nullptr ? 0
                               : res_.group.group()->shared_receive_buffers();
  }
  // Tests: the credits the peer has granted us so far (our allotment of
  // its receives), and ours of our receives that it holds.
  struct Allotments {
    uint32_t ours = 0;
    uint32_t peers = 0;
  };
  Allotments allotments();
  // Tests: the send buffers made so far (a first chunk, then more as
  // frames found none free, up to the peer's receives), and the frames
  // sent in buffers borrowed from the group's pool.
  uint32_t send_buffers_made();
  uint64_t borrowed_frames();
  // The group's send pool this connection borrows from, or null.
  SendPool* send_pool() const { return res_.send_pool; }
  // Why the connection has no windows to grant with (none on the device,
  // or it closed); OK while it has them.
  Status WindowsUnavailable() const;
  // The windows the connection made (kLandingWindows, or none).
  uint32_t landing_windows() const;
  ibv_cq* cq() const { return res_.group.cq(); }
  CompletionGroup* group() const { return res_.group.group(); }
  // Which of the group's completions are this connection's.
  uint32_t member_key() const { return res_.group.key(); }
  rdma_cm_id* cm_id() const { return res_.id.get(); }
  rdma_event_channel* cm_events() const { return res_.events.get(); }
  const ConnectionConfig& config() const { return config_; }

  // Work outstanding (posted work requests, calls waiting for the peer); a
  // server's shutdown flushes until there is none. Handlers count their
  // calls here. Posts a flush write when only unsignaled frames are left,
  // so that they too complete.
  bool Busy();
  // Posts a signaled zero-length write (no peer receive, no remote memory:
  // InfiniBand C9-88) behind unsignaled frames that no signaled work
  // request follows, so their completions and `sent` continuations come:
  // only when one of them has a `sent`, or with `any` always. True if it
  // posted one; a post that fails closes the connection. The engine calls
  // it before it sleeps.
  bool FlushUnsignaled(bool any = false);
  // Whether an unsignaled frame with a `sent` may wait for a flush: the
  // engine, before it sleeps, calls FlushUnsignaled only where this holds,
  // so idle connections cost it no lock. Set by the poster of such a frame
  // (the group's holder, whose give-back publishes it: others signal
  // theirs), cleared by a flush check that finds none uncovered.
  bool wants_flush() const {
    return flush_wanted_.load(std::memory_order_relaxed);
  }
  std::atomic<int> calls_waiting{0};

  // For the calls' progress watch (rdma_client.cc), as
  // Engine::NotStillBefore: a write waiting for the process's poster
  // thread (busy with another large write, say) holds this connection's
  // calls still, and that is no fault of the path. Returns `now` while one
  // waits, else when the last one was posted.
  std::chrono::steady_clock::time_point NotStillBefore(
      std::chrono::steady_clock::time_point now) const;

  // Remote-write access for one grant through a type-2 memory window of
  // this connection: only this queue pair can write through it, and only
  // until it ends. It covers a block of the landing arena
  // (landing_arena.h), or memory registered for this one grant
  // (LOCAL_WRITE | MW_BIND, no remote access of its own), which the grant
  // then owns. Ending it posts an invalidation; the block goes back to the
  // arena, and a registration is dropped (aside from kRegisterAsideBytes),
  // only once that completed or the connection's windows are gone,
  // whoever still holds views of the memory. Destroying it ends it too; a
  // reserved window (ReserveWindows) not bound yet is given back.
  // Move-only.
  class WindowGrant {
   public:
    WindowGrant() = default;
    WindowGrant(WindowGrant&& o) noexcept { *this = std::move(o); }
    WindowGrant& operator=(WindowGrant&& o) noexcept;
    ~WindowGrant() { End(nullptr); }

    // Bound: the peer may write through rkey().
    explicit operator bool() const { return !block_.empty(); }
    uint32_t rkey() const { return rkey_; }

    // Binds the reserved window over `block`, which `mr` (registered with
    // IBV_ACCESS_MW_BIND in this connection's domain) covers; the grant
    // keeps both. The bind is posted now, so it comes before any frame
    // queued after this returns. An error (the connection closed, or the
    // post failed, which closes it) leaves the window reserved and drops
    // `mr` (never bound, so it deregisters) with `block`.
    [[nodiscard]] Status Bind(TensorBuffer block, MemoryRegion mr);

    // Ends the access. True: `done` runs once on the polling thread, when
    // the peer can no longer write through the window (OK), or with the
    // error that closed the connection (its queue pair is gone then).
    // False when the connection is closed already (its queue pair no
    // longer takes writes) or the window was never bound: `done` never
    // runs.
    bool End(std::function<void(Status)> done);

   private:
    friend class Connection;
    std::weak_ptr<Connection> conn_;
    bool reserved_ = false;  // holds window_, bound or not
    uint32_t window_ = 0;
    uint32_t rkey_ = 0;
    TensorBuffer block_;
    MemoryRegion mr_;  // null over the arena
  };
  using WindowGrants = absl::InlinedVector<WindowGrant, 1>;
  // Runs once with the windows a waiting grant asked for, or with the
  // error that closed the connection (and none).
  using WindowsReady = std::function<void(Status, WindowGrants)>;
  // Reserves `count` windows for one grant's landings, all at once (a
  // grant that took some and waited for the rest could wait on another
  // doing the same). True when they are in `*windows` now, reserved and
  // not bound (WindowGrant::Bind, BindArenaWindow); none where none can be
  // had (no windows on the device, more needed than a connection has, the
  // connection closed): those landings are then registered for remote
  // write where the connection has a domain of its own, and fail their
  // call where it shares one (shares_domain).
  // False when fewer are free or an earlier grant waits: `wait` is called
  // under the connection's lock (it must only make the continuation), and
  // what it returns runs once the windows are free, first come first
  // served, on the thread that freed the last one (the poller, or the
  // registration thread) with no lock held, or from FinishClose with the
  // close's error.
  [[nodiscard]] bool ReserveWindows(uint32_t count, WindowGrants* windows,
                                    absl::FunctionRef<WindowsReady()> wait);
  // Binds the reserved window `grant` over `block` (a block of the landing
  // arena) for remote write; the bind is posted now, so it comes before
  // any frame queued after this returns (the grant that names it). An
  // error when the arena's segment is not registered in this connection's
  // protection domain (yet: the first grant in a segment starts
  // registering it aside, once per domain, arena_regions.h; or not at all,
  // with a locked-memory limit too low for the arena), or the post failed (the
  // connection closes): `grant` stays reserved, and the caller grants the
  // block another way (a registration of its own, under that window).
  [[nodiscard]] Status BindArenaWindow(WindowGrant& grant, TensorBuffer block);
  // Tests: connections made after this have `windows` landing windows
  // (0: kLandingWindows).
  static void SetLandingWindowsForTesting(uint32_t windows);

  // Counters for tests and stats (waits_for_credit: times a frame or write
  // had to wait for a peer receive or a send slot).
  using Counters = internal::FastPathCounters;
  Counters counters() const;

  // internal::CallerPoll: the thread that waits for its call polls the
  // connection's completion group alone for its spin (completing the
  // group's other calls too); the engine skips it meanwhile, and watches
  // it again only for calls left awaiting (completion_group.h).
  bool TakeForCaller() override;
  bool PollTaken() override;
  void GiveBack() override;
  void HandToEngine() override;
  // Whether this thread handles a completion of one connection while it
  // polls the group for a call it made on another (a blocked caller's
  // spin): a user's inline callback then goes to the callback thread.
  static bool PolledForAnotherCaller();
  // Times PollTaken found completions (for tests and stats).
  uint64_t caller_polls_found() const {
    return caller_polls_found_.load(std::memory_order_relaxed);
  }

  // The engine that polls this connection, set once by Engine::Add (null
  // before).
  Engine* engine() const { return engine_.load(); }
  void set_engine(Engine* engine) { engine_.store(engine); }

  // Engine use (engine thread only): tears the queue pair down after
  // Close() and runs the continuations. False, having done nothing, while
  // a caller holds the completion group (the engine tries again on its
  // next pass rather than wait for it).
  bool FinishClose();

 private:
  Connection(ConnectionResources resources, const ConnectionConfig& config,
             std::shared_ptr<Handler> handler);

  struct PendingFrame {
    std::vector<uint8_t> bytes;
    std::function<void(Status)> sent;
  };
  struct PendingWrite {
    WriteRequest request;
    uint64_t offset = 0;  // of the next piece
    std::function<void(Status)> done;
  };
  // What a posted send work request holds until its completion.
  struct Posted {
    uint64_t wr_id = 0;    // 0: a free slot
    int send_buffer = -1;  // frames: the send buffer to free
    std::function<void(Status)> done;
    // Order of tracking: posts under mu_ are tracked in the order they
    // reach the send queue; a write posted aside reaches it later still.
    uint64_t seq = 0;
    // A window's bind or invalidation: takes no slot of the credit
    // window (kWindowWorkRequests), and an invalidation frees its window.
    bool window_op = false;
    // Counted as awaited in a client group until it completes (see
    // TrackPostedLocked).
    bool awaited = false;
    int window = -1;
    // An invalidation's memory: released with the slot, once the peer can
    // no longer write into it (a registration once its window is gone too).
    TensorBuffer window_block = {};
    MemoryRegion window_mr = {};
  };

  friend class CompletionGroup;
  // One completion of this connection's, handed over by the thread that
  // holds its group. True when it was a shared receive whose buffer this
  // connection posted again (otherwise the group does).
  bool OnCompletion(const ibv_wc& wc);
  Status PostReceive(uint32_t index);
  // Posts what the window allows. Requires mu_; an error means the queue
  // pair is broken, or a connection is left with no send buffer it could
  // ever get, and the caller closes the connection.
  Status PumpLocked();
  // Registers another chunk of send buffers aside (one at a time, up to
  // the peer's receives): when a frame the credits allow (or, while the
  // pool lends, a credit return) finds none free, and after
  // kBorrowedFramesBeforeOwn borrowed frames. Requires mu_.
  void GrowSendsLocked();
  // Send buffer `index` (of free_send_buffers_) and its local key.
  // Require mu_. An index with kBorrowedBuffer set is the pool's.
  static constexpr int kBorrowedBuffer = 1 << 30;
  uint8_t* SendBuffer(int index) const;
  uint32_t SendKey(int index) const;
  // Whether a send buffer is free for a frame: one of ours, else one
  // borrowed from the group's pool while we have none of our own.
  // Requires mu_.
  bool SendBufferReadyLocked();
  // A frame's send buffer is free again: ours to reuse, or the pool's.
  // Requires mu_, and that the device no longer reads it.
  void ReleaseSendBufferLocked(int index);
  // Borrowed buffers not posted go back to the pool, and, once the queue
  // pair is gone, those of posted frames too. Requires mu_.
  void ReturnBorrowedLocked();
  // Copies a queued frame into the last free send buffer and posts it.
  Status PostFrameLocked(PendingFrame& frame, bool credit_only);
  // Posts the first `bytes` of the last free send buffer (an encoded frame)
  // with the credits to return. The caller took the window's slot.
  Status PostSendBufferLocked(size_t bytes, std::function<void(Status)> sent,
                              bool credit_only);
  // A frame that could not be posted: returns `why`, which makes the
  // caller close the connection, and keeps `sent` for FinishClose to fail
  // (a logged call's response must hear its fate).
  Status UnpostedLocked(Status why, std::function<void(Status)> sent);
  // The id of the next send work request: a sequence number over the
  // free posted_ slot it takes. A slot is not reused by wr_id order: a
  // write posted aside completes after frames posted after it.
  StatusOr<uint64_t> NextWrIdLocked();
  // Fills the slot `wr_id` names (the next free one) once it is posted.
  // In a client group, whose engine watches only what awaits, the work
  // request awaits its completion unless it is a frame with no `sent`: a
  // write's or flush's completion must come while no call is in flight.
  Status TrackPostedLocked(uint64_t wr_id, int send_buffer,
                           std::function<void(Status)> done,
                           bool signaled = true);
  // A signaled work request tracked as `seq` completed: so did every
  // unsignaled one tracked before it. Frees them, counts them into
  // `*completed` and moves their continuations to `sent`.
  using Continuations = absl::InlinedVector<std::function<void(Status)>, 2>;
  void ReleaseUnsignaledLocked(uint64_t seq, uint32_t* completed,
                               Continuations* sent);
  Posted* FindPostedLocked(uint64_t wr_id);
  void ForgetPostedLocked(Posted* posted);
  Status PostWritePieceLocked(PendingWrite& write, bool* finished);
  // Poster thread: posts a write piece queued by PostWritePieceLocked.
  void PostAside(ibv_send_wr wr, ibv_sge sge);
  // Makes this connection's windows (Create): an error (a device without
  // type-2 windows, say) stays in windows_unavailable_.
  Status SetUpWindows();
  // Posts a bind or invalidation of window `window` (wr.opcode and its
  // fields set); `done` runs as for a frame's `sent`, and `block` and `mr`
  // are held until then (moved from only when the post succeeded).
  // FlushUnsignaled's post: whether it posted one, or the post's error.
  StatusOr<bool> PostFlushLocked(bool any);
  Status PostWindowOpLocked(ibv_send_wr& wr, int window,
                            std::function<void(Status)> done,
                            TensorBuffer&& block = {}, MemoryRegion&& mr = {});
  // Moves `count` free windows, reserved, to `*windows`.
  void TakeWindowsLocked(uint32_t count, WindowGrants* windows);
  // Hands free windows to the waiting grants that they now cover, in
  // order, into `*ready` (run with no lock held).
  struct ReadyWaiter {
    WindowsReady ready;
    WindowGrants windows;
  };
  using ReadyWaiters = absl::InlinedVector<ReadyWaiter, 1>;
  void ServeWindowWaitersLocked(ReadyWaiters* ready);
  // Posts the bind of `grant`'s reserved window over `block` in `mr`.
  Status BindWindowLocked(WindowGrant& grant, ibv_mr* mr,
                          const TensorBuffer& block);
  // WindowGrant::Bind and End: End is false when the queue pair no longer
  // takes writes (the grant's memory is let go then, its registration
  // kept until the windows are gone).
  Status BindReserved(WindowGrant& grant, TensorBuffer block, MemoryRegion mr);
  bool EndWindow(WindowGrant& grant, std::function<void(Status)> done);
  void GiveBackWindow(uint32_t window);
  // A registration a window may still be bound over: deregistering it
  // fails until the window is invalidated or deallocated, so it waits for
  // FinishClose (which deallocates the windows) when they are still here.
  void KeepUntilWindowsGoLocked(MemoryRegion mr);
  // Drops registrations whose windows are invalidated or gone: here, or
  // aside from kRegisterAsideBytes (holding this connection, so its
  // domain, until then).
  void DropWindowRegion(MemoryRegion mr);
  Status CloseReason() const;
  bool HandleCompletion(const ibv_wc& wc);
  // FinishClose, on a shared receive queue: false while the queue pair
  // (moved to the error state) may still take a receive, up to
  // kLastSharedReceiveWait.
  bool AwaitLastSharedReceive();
  // The peer asked for more credits: grants what the receives backing
  // them allow (its own, or the group's pool's spare). Requires mu_.
  void GrantCreditsLocked();
  void Fail(const std::string& what);

  ConnectionResources res_;
  const ConnectionConfig config_;
  std::shared_ptr<Handler> handler_;
  std::atomic<bool> closed_{false};
  std::atomic<Engine*> engine_{nullptr};
  std::atomic<bool> broke_protocol_{false};
  std::atomic<std::chrono::steady_clock::rep> last_heard_{
      std::chrono::steady_clock::now().time_since_epoch().count()};
  // Set by FinishClose with the group held.
  std::atomic<bool> finished_{false};
  // The device reported the queue pair's last shared receive
  // (IBV_EVENT_QP_LAST_WQE_REACHED), and when FinishClose began to wait
  // for it (its engine's thread only; 0: not yet).
  std::atomic<bool> last_wqe_reached_{false};  // or the wait gave up
  std::chrono::steady_clock::rep last_wqe_wait_began_ = 0;
  std::atomic<uint64_t> caller_polls_found_{0};

  mutable std::mutex mu_;
  // Held by the poster thread while it posts (without mu_: a long post on
  // a software device must not hold the connection) and by FinishClose,
  // under mu_, while it destroys the queue pair.
  std::mutex post_mu_;
  CreditWindow window_;
  std::deque<PendingFrame> frames_;
  std::deque<PendingWrite> writes_;
  std::vector<std::function<void(Status)>> unposted_;  // see UnpostedLocked
  std::vector<int> free_send_buffers_;
  // Send buffers made so far (FirstSendBuffers, or 0 while the group's
  // pool lends them, then chunks up to peer_receives), and whether a chunk
  // is being registered aside (or a registration failed: no more are
  // tried).
  uint32_t send_buffers_made_ = 0;
  uint64_t borrowed_frames_ = 0;
  bool growing_sends_ = false;
  bool sends_grow_failed_ = false;
  std::vector<Posted> posted_;         // see TrackPostedLocked
  std::vector<uint32_t> free_posted_;  // slots of posted_ not in use
  // Unsignaled frames not yet known complete: their wr_ids in the order
  // they were posted (a ring of signal_interval_ slots).
  uint32_t signal_interval_ = 1;
  std::vector<uint64_t> unsignaled_;
  std::atomic<bool> flush_wanted_{false};  // written under mu_
  size_t unsignaled_head_ = 0;
  size_t unsignaled_count_ = 0;
  uint64_t next_seq_ = 1;
  uint64_t last_signaled_seq_ = 0;  // of the newest signaled one tracked
  // Write pieces handed to the poster thread and not yet posted. While
  // any are, later pieces go the same way, so they post in order (the
  // immediate that announces a write must not overtake its bytes).
  int aside_queued_ = 0;
  std::chrono::steady_clock::time_point aside_idle_since_;
  size_t posted_count_ = 0;
  int awaited_posted_ = 0;  // of posted_, how many count as awaited
  uint64_t next_wr_id_ = 1;
  Status close_reason_;
  const char* close_trigger_ = "";
  Counters counters_;
  // The windows, made with the connection (SetUpWindows), and the landing
  // arena's registrations in its own domain, made aside on first use of
  // each segment. Declared after res_, so they go before the protection
  // domain.
  Status windows_unavailable_;  // why there are none (OK: windows_ made)
  // The arena's segments registered in this connection's own domain; null
  // where it shares its group's (whose regions it uses).
  std::unique_ptr<ArenaRegions> own_arena_regions_;
  // Registrations a window may still be bound over, kept until
  // FinishClose deallocates the windows (KeepUntilWindowsGoLocked).
  // Declared before windows_, so they go after them.
  std::vector<MemoryRegion> regions_under_windows_;
  std::vector<MemoryWindow> windows_;
  std::vector<uint32_t> free_windows_;
  // Grants waiting for windows (ReserveWindows), oldest first.
  struct WindowWaiter {
    uint32_t count;
    WindowsReady ready;
  };
  std::deque<WindowWaiter> window_waiters_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_CONNECTION_H_
