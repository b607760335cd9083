#include "transport/rdma/connection.h"

#include <arpa/inet.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/coarse_clock.h"
#include "runtime/completion.h"
#include "runtime/fault_injection.h"
#include "runtime/spin.h"
#include "runtime/thread_pool.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

// Work request ids carry the connection's member key (completion_group.h)
// and, in CompletionGroup::kLocalMask: for a receive the buffer index (and
// kReceiveBit, above the key; a shared receive has key 0), for a send a
// sequence number shifted over
// the index of the slot it takes in Connection::posted_.
constexpr uint64_t kReceiveBit = CompletionGroup::kReceiveBit;
constexpr int kPostedSlotBits = 16;
constexpr uint64_t kPostedSlotMask = (uint64_t{1} << kPostedSlotBits) - 1;
constexpr uint64_t kSequenceMask =
    CompletionGroup::kLocalMask >> kPostedSlotBits;

CreditWindow::Options WindowOptions(const ConnectionConfig& c) {
  return {.peer_receives = c.peer_receives,
          .peer_first_receives = c.peer_first_receives,
          .send_queue_slots = c.send_queue_slots,
          .own_receives = c.receives,
          .own_first_receives = c.first_receives,
          .return_threshold = 0};
}

// The connection whose queue this thread polls now, if any: a frame it
// queues may leave its `sent` to a later completion, since this thread
// (or the engine after it) flushes before it stops polling.
thread_local const Connection* polling_here = nullptr;
// The connection whose call this thread waits for while it polls that
// connection's group (Connection::PollTaken), if any.
thread_local const Connection* polling_for_caller_of = nullptr;

// Never more than the first chunk of send buffers: the frames it leaves
// unsignaled hold theirs until a later one completes, and that one needs
// a buffer too, whether or not more chunks could be registered.
uint32_t SignalInterval(const ConnectionConfig& c) {
  const uint32_t first_sends = FirstSendBuffers(c.peer_receives);
  if (c.signal_interval > 0) return std::min(c.signal_interval, first_sends);
  return std::max<uint32_t>(1, std::min({16u, c.peer_receives / 2,
                                         c.send_queue_slots / 4, first_sends}));
}

// The poster thread (ConnectionConfig::post_aside_bytes). One for the
// process: a software device moves one write at a time per CPU anyway.
void RunOnPoster(std::function<void()> task) {
  // Never destroyed: connections may close during static destruction.
  static internal::ThreadPool* poster =
      new internal::ThreadPool(1, "rdmarpc-post");
  poster->Post(std::move(task));
}

// Connection::SetLandingWindowsForTesting (0: kLandingWindows).
std::atomic<uint32_t> landing_windows_for_testing{0};

// How long a closing connection on a shared receive queue of a hardware
// device waits for its queue pair's last-WQE event before it is destroyed
// anyway, and how often that happened
// (Connection::LastSharedReceiveWaitsTimedOut).
constexpr std::chrono::milliseconds kLastSharedReceiveWait(50);
std::atomic<uint64_t> last_wqe_waits_timed_out{0};

}  // namespace

StatusOr<std::shared_ptr<Connection>> Connection::Create(
    ConnectionResources resources, const ConnectionConfig& config,
    std::shared_ptr<Handler> handler) {
  RDMARPC_RETURN_IF_ERROR(CreditWindow::Validate(WindowOptions(config)));
  if (config.signal_interval > config.peer_receives / 2 ||
      config.signal_interval > config.send_queue_slots / 4) {
    // Frames left unsignaled hold send buffers and send slots until a
    // later completion: too many could leave none for that one.
    return absl::InvalidArgumentError(absl::StrCat(
        "signal_interval ", config.signal_interval,
        " exceeds half the peer's receives (", config.peer_receives,
        ") or a quarter of the send queue (", config.send_queue_slots, ")"));
  }
  if (config.send_queue_slots + kWindowWorkRequests > kPostedSlotMask) {
    return absl::InvalidArgumentError(
        absl::StrCat("send_queue_slots ", config.send_queue_slots, " exceeds ",
                     kPostedSlotMask));
  }
  if (!resources.group) {
    return absl::FailedPreconditionError(
        "the connection's resources have no completion group");
  }
  std::shared_ptr<Connection> conn(
      new Connection(std::move(resources), config, std::move(handler)));
  // Without windows landings are registered for remote write per call:
  // not fatal, the grants say why.
  (void)conn->SetUpWindows();
  // Before the first receive: the group's poller may find its completion
  // at once, before Engine::Add.
  conn->res_.group.Install(conn.get(), conn->res_.qp.get() == nullptr
                                           ? 0
                                           : conn->res_.qp.get()->qp_num);
  if (conn->res_.srq == nullptr) {
    for (uint32_t i = 0; i < config.receives; ++i) {
      RDMARPC_RETURN_IF_ERROR(conn->PostReceive(i));
    }
  }
  return conn;
}

Connection::Connection(ConnectionResources resources,
                       const ConnectionConfig& config,
                       std::shared_ptr<Handler> handler)
    : res_(std::move(resources)),
      config_(config),
      handler_(std::move(handler)),
      window_(WindowOptions(config)),
      posted_(config.send_queue_slots + kWindowWorkRequests),
      signal_interval_(SignalInterval(config)),
      unsignaled_(signal_interval_) {
  if (res_.own_pd != nullptr) {
    own_arena_regions_ = std::make_unique<ArenaRegions>(res_.own_pd.get());
  }
  // Borrowing from the group's pool, it makes its own later (or never).
  if (res_.send_pool == nullptr) {
    send_buffers_made_ = FirstSendBuffers(config.peer_receives);
    for (uint32_t i = 0; i < send_buffers_made_; ++i) {
      free_send_buffers_.push_back(static_cast<int>(i));
    }
  }
  res_.more_sends.reserve(config.peer_receives / kSendChunkBuffers);
  for (uint32_t i = 0; i < config.send_queue_slots + kWindowWorkRequests; ++i) {
    free_posted_.push_back(i);
  }
}

Connection::~Connection() {
  // Queued, or posted and never completed (the close was not finished):
  // awaited no more.
  if (res_.group) {
    res_.group.group()->RemoveAwaited(
        static_cast<int>(writes_.size() + frames_.size() + awaited_posted_));
  }
  // Never finished by an engine (its setup failed): its queue pair's last
  // completions are drained with the group held before it is destroyed,
  // so none reaches a later queue pair of the same number, and shared
  // receives among them go back to the pool.
  if (res_.srq != nullptr && res_.qp.get() != nullptr &&
      !finished_.load(std::memory_order_relaxed)) {
    // Other members' completions handled here may run callbacks: this
    // thread must not wait for a call meanwhile.
    internal::CompletionThreadScope scope;
    CompletionGroup* group = res_.group.group();
    const bool took = group->TakeBlocking();
    // Uninstalled first: nothing reaches this connection any more, and
    // the group posts its shared receives' buffers again.
    res_.group.Uninstall();
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    (void)ibv_modify_qp(res_.qp.get(), &attr, IBV_QP_STATE);
    group->DrainHeld();
    res_.qp.Reset();
    group->DrainAfterDestroyHeld();
    if (took) group->GiveBack();
  }
  // First: the group's poller must not hand a completion to a connection
  // whose members are going.
  res_.group.Uninstall();
  if (res_.send_pool != nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    ReturnBorrowedLocked();
  }
  // Arena regions FinishClose did not hand aside (a connection never
  // added) go with own_arena_regions_, after the windows (declared later).
}

Status Connection::PostReceive(uint32_t index) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(res_.receive_buffers.get() +
                                         size_t{index} * config_.receive_bytes);
  sge.length = config_.receive_bytes;
  sge.lkey = res_.receive_mr->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = kReceiveBit | res_.group.key_bits() | index;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_recv(res_.qp.get(), &wr, &bad);
  if (rc != 0) return VerbsError("ibv_post_recv", rc);
  return absl::OkStatus();
}

Status Connection::SendFrame(
    FrameType type, const FrameHead& head,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::function<void(Status)>&& sent, MessagePart message) {
  size_t inline_bytes = message.msg == nullptr ? 0 : message.bytes;
  for (const auto& p : inline_parts) inline_bytes += p.size();
  size_t total = FrameBytes(head.bytes(), inline_bytes);
  if (total > config_.peer_receive_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("frame of ", total, " bytes exceeds the peer's ",
                     config_.peer_receive_bytes, "-byte receive buffers"));
  }
  Status pumped;
  // Posted with its `sent`, it awaits its completion (TrackPostedLocked).
  bool awaits = sent != nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.load()) return close_reason_;
    // Credits first: a frame that waits for them holds no borrowed buffer.
    if (frames_.empty() && res_.qp.get() != nullptr &&
        window_.CanTakeForData() && SendBufferReadyLocked() &&
        window_.TryTakeForData()) {
      // The common case: encoded straight into a registered send buffer.
      uint8_t* dst = SendBuffer(free_send_buffers_.back());
      RDMARPC_ASSIGN_OR_RETURN(
          size_t written,
          EncodeFrame(type, 0, head, inline_parts,
                      std::span<uint8_t>(dst, config_.peer_receive_bytes),
                      message));
      pumped = PostSendBufferLocked(written, std::move(sent), false);
    } else {
      ++counters_.waits_for_credit;
      PendingFrame frame;
      frame.bytes.resize(total);
      RDMARPC_ASSIGN_OR_RETURN(
          size_t written,
          EncodeFrame(type, 0, head, inline_parts,
                      std::span<uint8_t>(frame.bytes), message));
      frame.bytes.resize(written);
      // Taken only now: on an error the caller still has it.
      frame.sent = std::move(sent);
      frames_.push_back(std::move(frame));
      res_.group.group()->AddAwaited();
      pumped = PumpLocked();
      awaits |= !frames_.empty();
    }
  }
  if (!pumped.ok()) Close(pumped, "post error");
  // What frees credits completes on the group: watched, though no call
  // may await anything there (a cancel's frame outlives its call).
  if (awaits) res_.group.group()->WakeEngineIfUnwatched();
  return absl::OkStatus();
}

Status Connection::Write(const WriteRequest& request,
                         std::function<void(Status)> done) {
  Status pumped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.load()) return close_reason_;
    if (!writes_.empty() || window_.free_send_slots() == 0) {
      ++counters_.waits_for_credit;
    }
    writes_.push_back(PendingWrite{request, 0, std::move(done)});
    res_.group.group()->AddAwaited();
    pumped = PumpLocked();
  }
  if (!pumped.ok()) Close(pumped, "post error");
  // Queued or posted, it awaits a completion in the group.
  res_.group.group()->WakeEngineIfUnwatched();
  return absl::OkStatus();
}

uint8_t* Connection::SendBuffer(int index) const {
  if ((index & kBorrowedBuffer) != 0) {
    return res_.send_pool->buffer(index & ~kBorrowedBuffer);
  }
  const auto i = static_cast<uint32_t>(index);
  const size_t offset =
      size_t{i % kSendChunkBuffers} * config_.peer_receive_bytes;
  return i < kSendChunkBuffers
             ? res_.send_buffers.get() + size_t{i} * config_.peer_receive_bytes
             : res_.more_sends[i / kSendChunkBuffers - 1].bytes.get() + offset;
}

uint32_t Connection::SendKey(int index) const {
  if ((index & kBorrowedBuffer) != 0) return res_.send_pool->lkey();
  const auto i = static_cast<uint32_t>(index);
  return i < kSendChunkBuffers
             ? res_.send_mr->lkey
             : res_.more_sends[i / kSendChunkBuffers - 1].mr->lkey;
}

bool Connection::SendBufferReadyLocked() {
  if (!free_send_buffers_.empty()) return true;
  // Borrowed only while none of our own are made: once they are, frames
  // wait for them (or for more of them) as without a pool.
  if (res_.send_pool == nullptr || send_buffers_made_ > 0) return false;
  const int lent = res_.send_pool->Take();
  if (lent < 0) return false;
  free_send_buffers_.push_back(lent | kBorrowedBuffer);
  return true;
}

void Connection::ReleaseSendBufferLocked(int index) {
  if ((index & kBorrowedBuffer) != 0) {
    res_.send_pool->Give(index & ~kBorrowedBuffer);
  } else {
    free_send_buffers_.push_back(index);
  }
}

void Connection::ReturnBorrowedLocked() {
  std::erase_if(free_send_buffers_, [this](int index) {
    if ((index & kBorrowedBuffer) == 0) return false;
    res_.send_pool->Give(index & ~kBorrowedBuffer);
    return true;
  });
  // Those of frames still posted only once the device can no longer read
  // them (a connection destroyed with its queue pair keeps them from the
  // pool: it never posted a frame).
  if (res_.qp.get() != nullptr) return;
  for (Posted& posted : posted_) {
    if (posted.send_buffer >= 0 &&
        (posted.send_buffer & kBorrowedBuffer) != 0) {
      res_.send_pool->Give(posted.send_buffer & ~kBorrowedBuffer);
      posted.send_buffer = -1;
    }
  }
}

void Connection::GrowSendsLocked() {
  if (growing_sends_ || sends_grow_failed_ ||
      send_buffers_made_ >= config_.peer_receives) {
    return;
  }
  growing_sends_ = true;
  const uint32_t count =
      std::min(kSendChunkBuffers, config_.peer_receives - send_buffers_made_);
  // Registering is slow (a system call, pinning): never on a poller.
  RunAside([self = shared_from_this(), count] {
    const size_t bytes = size_t{count} * self->config_.peer_receive_bytes;
    SendChunk chunk;
    chunk.bytes = std::make_unique<uint8_t[]>(bytes);
    auto mr = RegisterMemory(self->res_.pd, chunk.bytes.get(), bytes, 0);
    Status pumped;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->growing_sends_ = false;
      if (!mr.ok()) {
        // Frames keep to the buffers there are (PumpLocked gives up on a
        // connection left with none).
        self->sends_grow_failed_ = true;
        if (!self->closed_.load()) pumped = self->PumpLocked();
      } else {
        if (self->closed_.load()) return;
        if (self->send_buffers_made_ == 0) {
          // The first chunk of its own: the pool lent until now, and gets
          // back a buffer borrowed but not used yet.
          self->res_.send_buffers = std::move(chunk.bytes);
          self->res_.send_mr = *std::move(mr);
          self->ReturnBorrowedLocked();
        } else {
          chunk.mr = *std::move(mr);
          self->res_.more_sends.push_back(std::move(chunk));
        }
        for (uint32_t i = 0; i < count; ++i) {
          self->free_send_buffers_.push_back(
              static_cast<int>(self->send_buffers_made_ + i));
        }
        self->send_buffers_made_ += count;
        pumped = self->PumpLocked();
      }
    }
    if (!pumped.ok()) self->Close(pumped, "post error");
  });
}

Status Connection::PostFrameLocked(PendingFrame& frame, bool credit_only) {
  std::memcpy(SendBuffer(free_send_buffers_.back()), frame.bytes.data(),
              frame.bytes.size());
  return PostSendBufferLocked(frame.bytes.size(), std::move(frame.sent),
                              credit_only);
}

Status Connection::PostSendBufferLocked(size_t bytes,
                                        std::function<void(Status)> sent,
                                        bool credit_only) {
  int buffer = free_send_buffers_.back();
  uint8_t* dst = SendBuffer(buffer);
  // The credits field (preamble bytes 4..5) is filled at post time.
  uint32_t credits = std::min<uint32_t>(window_.TakeReturnable(), 0xffff);
  dst[4] = static_cast<uint8_t>(credits);
  dst[5] = static_cast<uint8_t>(credits >> 8);
  // Flags (bytes 6..7): the wire's only one fits the low byte.
  dst[6] = window_.WantsCredits() ? kFlagWantsCredits : 0;
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(dst);
  sge.length = static_cast<uint32_t>(bytes);
  sge.lkey = SendKey(buffer);
  ibv_send_wr wr{};
  StatusOr<uint64_t> wr_id = NextWrIdLocked();
  if (!wr_id.ok()) return UnpostedLocked(wr_id.status(), std::move(sent));
  wr.wr_id = *wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  // Another thread's `sent` would wait for a flush nobody is bound to make;
  // a borrowed buffer goes back to the pool with its own completion.
  const bool borrowed = (buffer & kBorrowedBuffer) != 0;
  const bool signaled = (sent != nullptr && polling_here != this) || borrowed ||
                        unsignaled_count_ + 1 >= signal_interval_;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(res_.qp.get(), &wr, &bad);
  if (rc != 0) {
    return UnpostedLocked(VerbsError("ibv_post_send (frame)", rc),
                          std::move(sent));
  }
  free_send_buffers_.pop_back();
  RDMARPC_RETURN_IF_ERROR(
      TrackPostedLocked(wr.wr_id, buffer, std::move(sent), signaled));
  // Busy enough for buffers of its own (registered aside; it borrows
  // meanwhile).
  if (borrowed && ++borrowed_frames_ == kBorrowedFramesBeforeOwn) {
    GrowSendsLocked();
  }
  ++counters_.frames_sent;
  if (!signaled) ++counters_.frames_unsignaled;
  if (credit_only) ++counters_.credit_frames_sent;
  return absl::OkStatus();
}

Status Connection::UnpostedLocked(Status why,
                                  std::function<void(Status)> sent) {
  if (sent) unposted_.push_back(std::move(sent));
  return why;
}

StatusOr<uint64_t> Connection::NextWrIdLocked() {
  // The window keeps at most send_queue_slots posted, and windows at most
  // kWindowWorkRequests, so a slot is free whenever either lets one go.
  if (free_posted_.empty()) {
    return absl::InternalError("no free slot for a send work request");
  }
  return ((next_wr_id_++ & kSequenceMask) << kPostedSlotBits) |
         res_.group.key_bits() | free_posted_.back();
}

Status Connection::TrackPostedLocked(uint64_t wr_id, int send_buffer,
                                     std::function<void(Status)> done,
                                     bool signaled) {
  const uint32_t slot = static_cast<uint32_t>(wr_id & kPostedSlotMask);
  if (free_posted_.empty() || free_posted_.back() != slot) {
    return absl::InternalError(absl::StrCat(
        "send work request ", wr_id, " does not hold the next free slot"));
  }
  free_posted_.pop_back();
  const uint64_t seq = next_seq_++;
  posted_[slot] = Posted{wr_id, send_buffer, std::move(done), seq};
  ++posted_count_;
  if ((send_buffer < 0 || posted_[slot].done) &&
      !res_.group.group()->serves()) {
    posted_[slot].awaited = true;
    ++awaited_posted_;
    res_.group.group()->AddAwaited();
  }
  if (signaled) {
    last_signaled_seq_ = seq;
  } else {
    unsignaled_[(unsignaled_head_ + unsignaled_count_) % unsignaled_.size()] =
        wr_id;
    ++unsignaled_count_;
    if (posted_[slot].done) {
      flush_wanted_.store(true, std::memory_order_relaxed);
    }
  }
  return absl::OkStatus();
}

void Connection::ReleaseUnsignaledLocked(uint64_t seq, uint32_t* completed,
                                         Continuations* sent) {
  while (unsignaled_count_ > 0) {
    Posted* posted = FindPostedLocked(unsignaled_[unsignaled_head_]);
    // Gone: it failed (a flush error) and ran its continuation then.
    if (posted != nullptr) {
      if (posted->seq > seq) return;
      if (posted->send_buffer >= 0) {
        ReleaseSendBufferLocked(posted->send_buffer);
      }
      if (posted->done) sent->push_back(std::move(posted->done));
      ForgetPostedLocked(posted);
      ++*completed;
    }
    unsignaled_head_ = (unsignaled_head_ + 1) % unsignaled_.size();
    --unsignaled_count_;
  }
  // Loaded first: most completions find it clear, and leave its line so.
  if (flush_wanted_.load(std::memory_order_relaxed)) {
    flush_wanted_.store(false, std::memory_order_relaxed);
  }
}

bool Connection::FlushUnsignaled(bool any) {
  StatusOr<bool> posted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted = PostFlushLocked(any);
  }
  if (posted.ok()) return *posted;
  // The slot stays taken: the connection is broken, and closing it fails
  // the unsignaled frames' continuations.
  Close(posted.status(), "post error");
  return false;
}

StatusOr<bool> Connection::PostFlushLocked(bool any) {
  if (unsignaled_count_ == 0 || closed_.load() || res_.qp.get() == nullptr) {
    flush_wanted_.store(false, std::memory_order_relaxed);
    return false;
  }
  // Those before a signaled one still outstanding are covered by it (once
  // it completes it releases them); a flush is for those after it.
  bool uncovered = false;
  bool waiting_sent = false;
  for (size_t i = 0; i < unsignaled_count_; ++i) {
    Posted* posted = FindPostedLocked(
        unsignaled_[(unsignaled_head_ + i) % unsignaled_.size()]);
    if (posted == nullptr || posted->seq < last_signaled_seq_) continue;
    uncovered = true;
    waiting_sent |= posted->done != nullptr;
  }
  // Still wanted only while a `sent` waits and no flush is posted below.
  flush_wanted_.store(waiting_sent, std::memory_order_relaxed);
  if (!uncovered) return false;
  if (!(any || waiting_sent) || !window_.TryTakeSendSlot()) return false;
  ibv_send_wr wr{};
  RDMARPC_ASSIGN_OR_RETURN(wr.wr_id, NextWrIdLocked());
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  // Fault injection: the post fails as on a broken queue pair.
  const int rc = RDMARPC_FAULT("rdma.flush_write_post_error")
                     ? EIO
                     : ibv_post_send(res_.qp.get(), &wr, &bad);
  if (rc != 0) return VerbsError("ibv_post_send (a flush write)", rc);
  RDMARPC_RETURN_IF_ERROR(TrackPostedLocked(wr.wr_id, -1, nullptr));
  ++counters_.flush_writes;
  flush_wanted_.store(false, std::memory_order_relaxed);
  return true;
}

Connection::Posted* Connection::FindPostedLocked(uint64_t wr_id) {
  const uint64_t slot = wr_id & kPostedSlotMask;
  if (slot >= posted_.size() || posted_[slot].wr_id != wr_id) return nullptr;
  return &posted_[slot];
}

void Connection::ForgetPostedLocked(Posted* posted) {
  if (posted->awaited) {
    --awaited_posted_;
    res_.group.group()->RemoveAwaited();
  }
  free_posted_.push_back(static_cast<uint32_t>(posted - posted_.data()));
  *posted = Posted{};
  --posted_count_;
}

Status Connection::PostWritePieceLocked(PendingWrite& write, bool* finished) {
  const WriteRequest& r = write.request;
  uint64_t piece = std::min(r.length - write.offset, config_.max_write_bytes);
  bool last = write.offset + piece == r.length;
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(r.local) + write.offset;
  sge.length = static_cast<uint32_t>(piece);
  sge.lkey = r.lkey;
  ibv_send_wr wr{};
  RDMARPC_ASSIGN_OR_RETURN(wr.wr_id, NextWrIdLocked());
  wr.sg_list = piece == 0 ? nullptr : &sge;
  wr.num_sge = piece == 0 ? 0 : 1;
  wr.opcode =
      last && r.immediate ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (last && r.immediate) wr.imm_data = htonl(*r.immediate);
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = r.remote_addr + write.offset;
  wr.wr.rdma.rkey = r.rkey;
  const bool aside =
      config_.post_aside_bytes > 0 &&
      (aside_queued_ > 0 || r.length >= config_.post_aside_bytes);
  if (!aside) {
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(res_.qp.get(), &wr, &bad);
    if (rc != 0) return VerbsError("ibv_post_send (write)", rc);
  }
  write.offset += piece;
  ++counters_.writes_posted;
  *finished = last;
  std::function<void(Status)> on_completion;
  if (last) {
    on_completion = std::move(write.done);
  } else if (r.on_piece) {
    // A failed piece decides nothing: the close fails the write's `done`.
    on_completion = [moved = r.on_piece](Status s) {
      if (s.ok()) moved();
    };
  }
  // Tracked before the poster posts it, so its completion finds it.
  RDMARPC_RETURN_IF_ERROR(
      TrackPostedLocked(wr.wr_id, -1, std::move(on_completion)));
  if (aside) {
    ++aside_queued_;
    ++counters_.writes_posted_aside;
    RunOnPoster(
        [self = shared_from_this(), wr, sge] { self->PostAside(wr, sge); });
  }
  return absl::OkStatus();
}

void Connection::PostAside(ibv_send_wr wr, ibv_sge sge) {
  // Fault injection: a test holds the poster thread here, or slows every
  // post as a crawling path would.
  internal::fault::HoldWhileArmed("rdma.post_aside.hold",
                                  "rdma.post_aside.held");
  if (auto delay = internal::fault::Take("rdma.post_aside.delay_ms")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
  }
  if (wr.num_sge > 0) wr.sg_list = &sge;
  int rc = 0;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    // Gone: FinishClose has run the piece's continuation.
    if (res_.qp.get() != nullptr) {
      ibv_send_wr* bad = nullptr;
      rc = ibv_post_send(res_.qp.get(), &wr, &bad);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--aside_queued_ == 0) aside_idle_since_ = internal::CoarseSteadyNow();
  }
  // The piece stays tracked: the close fails its continuation.
  if (rc != 0) Close(VerbsError("ibv_post_send (write)", rc), "post error");
}

Status Connection::PumpLocked() {
  if (res_.qp.get() == nullptr) return absl::OkStatus();
  // A send buffer comes back with its frame's completion, which for an
  // unsignaled frame may come after the peer returned its receive.
  // Credits first: a frame that waits for them holds no borrowed buffer.
  bool wants_buffer = false;
  while (!frames_.empty() && window_.CanTakeForData()) {
    if (!SendBufferReadyLocked()) {
      wants_buffer = true;
      break;
    }
    if (!window_.TryTakeForData()) break;
    RDMARPC_RETURN_IF_ERROR(PostFrameLocked(frames_.front(), false));
    frames_.pop_front();
    res_.group.group()->RemoveAwaited();
  }
  while (!writes_.empty()) {
    PendingWrite& w = writes_.front();
    uint64_t remaining = w.request.length - w.offset;
    bool last = remaining <= config_.max_write_bytes;
    bool taken = last && w.request.immediate ? window_.TryTakeForData()
                                             : window_.TryTakeSendSlot();
    if (!taken) break;
    bool finished = false;
    RDMARPC_RETURN_IF_ERROR(PostWritePieceLocked(w, &finished));
    if (finished) {
      writes_.pop_front();
      res_.group.group()->RemoveAwaited();
    }
  }
  if (window_.ShouldSendCreditReturn() && window_.CanTakeForCreditReturn()) {
    if (!SendBufferReadyLocked()) {
      // Our own come back with completions that pump again; the pool's
      // come back to no one in particular.
      if (send_buffers_made_ == 0) wants_buffer = true;
    } else if (window_.TryTakeForCreditReturn()) {
      PendingFrame credit;
      credit.bytes.resize(kPreambleBytes);
      RDMARPC_RETURN_IF_ERROR(EncodeFrame(FrameType::kCredit, 0, {}, {},
                                          std::span<uint8_t>(credit.bytes))
                                  .status());
      RDMARPC_RETURN_IF_ERROR(PostFrameLocked(credit, true));
    }
  }
  if (wants_buffer) {
    // None of our own and none can be made, and nothing of ours in flight
    // whose completion would pump again (a frame of another connection
    // giving a buffer back to the pool does not): the frames would wait
    // for good. Closing sends the calls over gRPC.
    if (sends_grow_failed_ && send_buffers_made_ == 0 && posted_count_ == 0) {
      return absl::ResourceExhaustedError(
          "no send buffer: the group's pool has none free and this "
          "connection could not register its own");
    }
    GrowSendsLocked();
  }
  return absl::OkStatus();
}

bool Connection::Busy() {
  if (calls_waiting.load(std::memory_order_relaxed) > 0) return true;
  // Its completion awaits: an engine asleep on an unarmed group must see it.
  if (FlushUnsignaled(/*any=*/true)) HandToEngine();
  std::lock_guard<std::mutex> lock(mu_);
  return posted_count_ > 0;
}

std::chrono::steady_clock::time_point Connection::NotStillBefore(
    std::chrono::steady_clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return aside_queued_ > 0 ? now : aside_idle_since_;
}

Connection::Counters Connection::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

bool Connection::TakeForCaller() {
  if (finished_.load(std::memory_order_relaxed)) return false;
  return res_.group.group()->TryTake();
}

bool Connection::PollTaken() {
  // What completes here runs on the waiting thread, which must not block
  // for a call of its own meanwhile (an inline callback that tried would
  // wait for itself): it counts as a completion thread while it polls.
  internal::CompletionThreadScope scope;
  const Connection* outer = polling_for_caller_of;
  polling_for_caller_of = this;
  const int found = res_.group.group()->PollHeld();
  polling_for_caller_of = outer;
  if (found == 0) return false;
  caller_polls_found_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool Connection::PolledForAnotherCaller() {
  return polling_for_caller_of != nullptr &&
         polling_for_caller_of != polling_here;
}

void Connection::GiveBack() { res_.group.group()->GiveBack(); }

void Connection::HandToEngine() { res_.group.group()->WakeEngineIfUnwatched(); }

bool Connection::OnCompletion(const ibv_wc& wc) {
  const Connection* outer = polling_here;
  polling_here = this;
  const bool reposted = HandleCompletion(wc);
  polling_here = outer;
  return reposted;
}

Connection::Allotments Connection::allotments() {
  std::lock_guard<std::mutex> lock(mu_);
  return {window_.peer_allotment(), window_.own_allotment()};
}

uint64_t Connection::borrowed_frames() {
  std::lock_guard<std::mutex> lock(mu_);
  return borrowed_frames_;
}

uint32_t Connection::send_buffers_made() {
  std::lock_guard<std::mutex> lock(mu_);
  return send_buffers_made_;
}

void Connection::GrantCreditsLocked() {
  const uint32_t wanted = window_.GrantWanted();
  if (wanted == 0) return;
  // Own receives: all of them are posted, so any grant is backed.
  const uint32_t granted =
      res_.srq == nullptr ? wanted : res_.group.AllotShared(wanted);
  if (granted == 0) return;
  window_.Grant(granted);
  counters_.credits_granted += granted;
}

void Connection::Fail(const std::string& what) {
  Close(absl::UnavailableError(absl::StrCat("RDMA connection failed: ", what)),
        "work-completion error");
}

bool Connection::HandleCompletion(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (!closed_.load()) {
      Fail(absl::StrCat(ibv_wc_status_str(wc.status), " on a ",
                        wc.wr_id & kReceiveBit ? "receive" : "send",
                        " (vendor error ", wc.vendor_err, ")"));
    }
    if ((wc.wr_id & kReceiveBit) == 0) {
      std::function<void(Status)> done;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (Posted* posted = FindPostedLocked(wc.wr_id)) {
          done = std::move(posted->done);
          // Completed, if in error: the device no longer reads its buffer,
          // so a borrowed one goes back (ours stay with the closing
          // connection).
          if (posted->send_buffer >= 0 &&
              (posted->send_buffer & kBorrowedBuffer) != 0) {
            ReleaseSendBufferLocked(posted->send_buffer);
          }
          // An invalidation that failed may leave its window bound.
          if (posted->window_mr != nullptr) {
            KeepUntilWindowsGoLocked(std::move(posted->window_mr));
          }
          ForgetPostedLocked(posted);
        }
      }
      if (done) done(CloseReason());
    }
    return false;
  }
  if (wc.wr_id & kReceiveBit) {
    last_heard_.store(internal::CoarseSteadyNow().time_since_epoch().count(),
                      std::memory_order_relaxed);
    uint32_t index =
        static_cast<uint32_t>(wc.wr_id & CompletionGroup::kLocalMask);
    Status handled;
    bool framed = false;
    bool wants_credits = false;
    uint32_t credits = 0;
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      handled = handler_->OnWriteLanded(ntohl(wc.imm_data));
    } else {
      const char* bytes = reinterpret_cast<const char*>(
          res_.srq != nullptr ? res_.group.group()->SharedReceiveBuffer(index)
                              : res_.receive_buffers.get() +
                                    size_t{index} * config_.receive_bytes);
      auto frame = DecodeFrame(std::string_view(bytes, wc.byte_len));
      if (!frame.ok()) {
        handled = frame.status();
      } else {
        // The receives it returns count below, with the re-post: one lock
        // per frame. A frame that the handler sends meanwhile waits for
        // them only when the peer's receives ran out, and then goes with
        // the re-post's pump. More than the peer could ever owe is refused
        // before its frame is acted on; the exact check (more than it owes
        // now) comes with the count.
        framed = true;
        credits = frame->credits;
        wants_credits = frame->wants_credits;
        if (credits > config_.peer_receives) {
          handled = absl::InvalidArgumentError(absl::StrCat(
              "a frame returns ", credits, " receive credits; at most ",
              config_.peer_receives, " were ever owed"));
        } else if (frame->type != FrameType::kCredit) {
          handled = handler_->OnFrame(*frame);
        }
      }
    }
    Status s;
    bool reposted = false;
    if (handled.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_.load()) return false;
      if (framed) {
        ++counters_.frames_received;
        handled = window_.OnPeerReturned(credits);
      }
      if (handled.ok()) {
        // Posted again before its credit can go back to the peer.
        s = res_.srq != nullptr ? res_.group.group()->RepostShared(index)
                                : PostReceive(index);
        // Tried: a shared buffer that failed is counted out of the pool.
        reposted = true;
        // A frame past the peer's allotment breaks the protocol.
        if (s.ok()) handled = window_.OnReceiveReposted();
        if (s.ok() && handled.ok()) {
          if (wants_credits) GrantCreditsLocked();
          s = PumpLocked();
        }
      }
    }
    // A shared buffer not tried here is the group's to post.
    const bool posted_shared = reposted && res_.srq != nullptr;
    if (!handled.ok()) {
      broke_protocol_.store(true);
      Close(absl::UnavailableError(absl::StrCat(
                "RDMA connection closed: the peer broke the protocol: ",
                handled.message())),
            "protocol error");
      return posted_shared;
    }
    if (!s.ok()) Close(s, "post error");
    return posted_shared;
  }
  std::function<void(Status)> done;
  Continuations sent;
  MemoryRegion unbound;   // the registration an invalidation ended
  TensorBuffer released;  // and its memory: a user's deleter may run
  ReadyWaiters waiters;   // grants the freed window completes
  Status s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Posted* posted = FindPostedLocked(wc.wr_id);
    if (posted == nullptr) return false;
    if (posted->send_buffer >= 0) {
      ReleaseSendBufferLocked(posted->send_buffer);
    }
    done = std::move(posted->done);
    uint32_t completed = posted->window_op ? 0 : 1;
    if (posted->window >= 0) {
      free_windows_.push_back(static_cast<uint32_t>(posted->window));
      unbound = std::move(posted->window_mr);
      released = std::move(posted->window_block);
      if (!window_waiters_.empty()) ServeWindowWaitersLocked(&waiters);
    }
    ReleaseUnsignaledLocked(posted->seq, &completed, &sent);
    ForgetPostedLocked(posted);
    if (completed > 0) s = window_.OnSendCompleted(completed);
    if (s.ok() && !closed_.load()) s = PumpLocked();
  }
  for (auto& f : sent) f(absl::OkStatus());
  if (done) done(absl::OkStatus());
  DropWindowRegion(std::move(unbound));
  for (ReadyWaiter& w : waiters)
    w.ready(absl::OkStatus(), std::move(w.windows));
  if (!s.ok()) Close(s, "post error");
  return false;
}

Connection::WindowGrant& Connection::WindowGrant::operator=(
    WindowGrant&& o) noexcept {
  if (this != &o) {
    End(nullptr);
    conn_ = std::move(o.conn_);
    reserved_ = std::exchange(o.reserved_, false);
    window_ = o.window_;
    rkey_ = o.rkey_;
    block_ = std::move(o.block_);
    o.block_ = TensorBuffer();
    mr_ = std::move(o.mr_);
  }
  return *this;
}

Status Connection::WindowGrant::Bind(TensorBuffer block, MemoryRegion mr) {
  std::shared_ptr<Connection> conn = conn_.lock();
  if (!reserved_ || !block_.empty() || conn == nullptr) {
    return absl::FailedPreconditionError(
        "a landing window bound without a reservation");
  }
  return conn->BindReserved(*this, std::move(block), std::move(mr));
}

bool Connection::WindowGrant::End(std::function<void(Status)> done) {
  if (!std::exchange(reserved_, false)) return false;
  std::shared_ptr<Connection> conn = conn_.lock();
  conn_.reset();
  if (conn == nullptr) {
    // The connection is gone, and its windows with it: the registration
    // deregisters.
    block_ = TensorBuffer();
    mr_.reset();
    return false;
  }
  if (block_.empty()) {
    conn->GiveBackWindow(window_);
    return false;
  }
  // Ending or not, the connection holds what the grant covered now.
  return conn->EndWindow(*this, std::move(done));
}

void Connection::TakeWindowsLocked(uint32_t count, WindowGrants* windows) {
  for (uint32_t i = 0; i < count; ++i) {
    WindowGrant& grant = windows->emplace_back();
    grant.conn_ = weak_from_this();
    grant.reserved_ = true;
    grant.window_ = free_windows_.back();
    free_windows_.pop_back();
  }
}

bool Connection::ReserveWindows(uint32_t count, WindowGrants* windows,
                                absl::FunctionRef<WindowsReady()> wait) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_.load() || res_.qp.get() == nullptr ||
      !windows_unavailable_.ok()) {
    return true;
  }
  // Fault injection: a device without type-2 windows, so that landings
  // are registered for remote write per call.
  if (RDMARPC_FAULT("rdma.no_landing_windows")) return true;
  // More than the connection has: those landings get none.
  if (count == 0 || count > windows_.size()) return true;
  if (window_waiters_.empty() && count <= free_windows_.size()) {
    TakeWindowsLocked(count, windows);
    return true;
  }
  window_waiters_.push_back({count, wait()});
  ++counters_.landing_window_waits;
  return false;
}

void Connection::ServeWindowWaitersLocked(ReadyWaiters* ready) {
  // A closing connection's waiters hear it from FinishClose.
  while (!window_waiters_.empty() && !closed_.load()) {
    WindowWaiter& waiter = window_waiters_.front();
    if (waiter.count > free_windows_.size()) return;
    ReadyWaiter& r = ready->emplace_back();
    r.ready = std::move(waiter.ready);
    TakeWindowsLocked(waiter.count, &r.windows);
    window_waiters_.pop_front();
  }
}

Status Connection::BindWindowLocked(WindowGrant& grant, ibv_mr* mr,
                                    const TensorBuffer& block) {
  ibv_mw* mw = windows_[grant.window_].get();
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info.mr = mr;
  wr.bind_mw.bind_info.addr = reinterpret_cast<uintptr_t>(block.data());
  wr.bind_mw.bind_info.length = block.size();
  wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
  RDMARPC_RETURN_IF_ERROR(PostWindowOpLocked(wr, -1, nullptr));
  // The window's key from now on. A type-2 bind posted on the queue pair
  // leaves updating it to us, and providers (rxe) name the window by it
  // in the next bind.
  mw->rkey = rkey;
  grant.rkey_ = rkey;
  ++counters_.landing_windows;
  return absl::OkStatus();
}

Status Connection::BindArenaWindow(WindowGrant& grant, TensorBuffer block) {
  LandingArena* arena = LandingArena::Get();
  const int segment = arena == nullptr ? -1 : arena->SegmentOf(block.data());
  if (segment < 0) {
    return absl::InternalError(
        "a landing window for memory outside the landing arena");
  }
  Status posted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!grant.reserved_ || grant || grant.conn_.lock().get() != this) {
      return absl::FailedPreconditionError(
          "a landing window bound without a reservation");
    }
    if (closed_.load()) return close_reason_;
    // Registered once per protection domain: the group's where this
    // connection shares its domain, or its own.
    Status why;
    ibv_mr* mr =
        own_arena_regions_ != nullptr
            ? own_arena_regions_->Find(segment, shared_from_this(), &why)
            : res_.group.group()->arena_regions()->Find(
                  segment, res_.group.group()->shared_from_this(), &why);
    if (mr == nullptr) return why;
    posted = BindWindowLocked(grant, mr, block);
    if (posted.ok()) {
      grant.block_ = std::move(block);
      return absl::OkStatus();
    }
  }
  Close(posted, "post error");
  return posted;
}

Status Connection::BindReserved(WindowGrant& grant, TensorBuffer block,
                                MemoryRegion mr) {
  Status posted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.load()) return close_reason_;
    posted = BindWindowLocked(grant, mr.get(), block);
    if (posted.ok()) {
      grant.block_ = std::move(block);
      grant.mr_ = std::move(mr);
      return absl::OkStatus();
    }
  }
  Close(posted, "post error");
  return posted;
}

void Connection::GiveBackWindow(uint32_t window) {
  ReadyWaiters waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Closed: FinishClose deallocated the windows, or will.
    if (closed_.load()) return;
    free_windows_.push_back(window);
    if (!window_waiters_.empty()) ServeWindowWaitersLocked(&waiters);
  }
  // The caller may hold an endpoint's lock, which the waiters take.
  for (ReadyWaiter& w : waiters) {
    RunAside([w = std::make_shared<ReadyWaiter>(std::move(w))] {
      w->ready(absl::OkStatus(), std::move(w->windows));
    });
  }
}

Status Connection::WindowsUnavailable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_.load()) return close_reason_;
  return windows_unavailable_;
}

uint32_t Connection::landing_windows() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint32_t>(windows_.size());
}

void Connection::SetLandingWindowsForTesting(uint32_t windows) {
  landing_windows_for_testing.store(windows);
}

Status Connection::SetUpWindows() {
  Status ready = [&]() -> Status {
    ibv_device_attr attr{};
    if (int rc = ibv_query_device(res_.pd->context, &attr); rc != 0) {
      return VerbsError("ibv_query_device", rc);
    }
    if ((attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) == 0) {
      return absl::UnimplementedError(absl::StrCat(
          ibv_get_device_name(res_.pd->context->device),
          " has no type-2 memory windows: landing memory is registered "
          "per call for remote write"));
    }
    const uint32_t count = landing_windows_for_testing.load();
    for (uint32_t i = 0; i < (count == 0 ? kLandingWindows : count); ++i) {
      errno = 0;
      MemoryWindow mw(ibv_alloc_mw(res_.pd, IBV_MW_TYPE_2));
      if (mw == nullptr) {
        return VerbsError("ibv_alloc_mw", errno != 0 ? errno : ENOMEM);
      }
      windows_.push_back(std::move(mw));
    }
    return absl::OkStatus();
  }();
  if (!ready.ok()) {
    windows_.clear();
    windows_unavailable_ = std::move(ready);
    return windows_unavailable_;
  }
  for (uint32_t i = 0; i < windows_.size(); ++i) free_windows_.push_back(i);
  return absl::OkStatus();
}

Status Connection::PostWindowOpLocked(ibv_send_wr& wr, int window,
                                      std::function<void(Status)> done,
                                      TensorBuffer&& block, MemoryRegion&& mr) {
  RDMARPC_ASSIGN_OR_RETURN(wr.wr_id, NextWrIdLocked());
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(res_.qp.get(), &wr, &bad); rc != 0) {
    return VerbsError(wr.opcode == IBV_WR_BIND_MW
                          ? "ibv_post_send (bind a landing window)"
                          : "ibv_post_send (invalidate a landing window)",
                      rc);
  }
  RDMARPC_RETURN_IF_ERROR(TrackPostedLocked(wr.wr_id, -1, std::move(done)));
  Posted* posted = FindPostedLocked(wr.wr_id);
  posted->window_op = true;
  posted->window = window;
  posted->window_block = std::move(block);
  posted->window_mr = std::move(mr);
  return absl::OkStatus();
}

bool Connection::EndWindow(WindowGrant& grant,
                           std::function<void(Status)> done) {
  Status posted;
  // Let go of after the lock: a user's deleter may run.
  TensorBuffer released = std::move(grant.block_);
  grant.block_ = TensorBuffer();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Closed: rdma_disconnect moved the queue pair to the error state, so
    // nothing writes through the window any more.
    if (closed_.load() || res_.qp.get() == nullptr) {
      if (grant.mr_ != nullptr) KeepUntilWindowsGoLocked(std::move(grant.mr_));
      return false;
    }
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = grant.rkey_;
    posted =
        PostWindowOpLocked(wr, static_cast<int>(grant.window_), std::move(done),
                           std::move(released), std::move(grant.mr_));
    if (!posted.ok() && grant.mr_ != nullptr) {
      // Not posted: the window stays bound until FinishClose deallocates
      // it.
      KeepUntilWindowsGoLocked(std::move(grant.mr_));
    }
  }
  if (posted.ok()) return true;
  // Closing the connection takes the queue pair's access.
  Close(posted, "post error");
  return false;
}

void Connection::KeepUntilWindowsGoLocked(MemoryRegion mr) {
  if (!windows_.empty()) {
    regions_under_windows_.push_back(std::move(mr));
    return;
  }
  // FinishClose deallocated the windows already (or there were none).
  std::vector<MemoryRegion> mrs;
  mrs.push_back(std::move(mr));
  DeregisterAside(std::move(mrs), shared_from_this());
}

void Connection::DropWindowRegion(MemoryRegion mr) {
  if (mr == nullptr || mr->length < kRegisterAsideBytes) return;  // here
  std::vector<MemoryRegion> large;
  large.push_back(std::move(mr));
  DeregisterAside(std::move(large), shared_from_this());
}

Status Connection::CloseReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return close_reason_.ok() ? absl::UnavailableError("RDMA connection closed")
                            : close_reason_;
}

std::string Connection::close_trigger() const {
  std::lock_guard<std::mutex> lock(mu_);
  return close_trigger_;
}

void Connection::Close(Status why, const char* trigger) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.exchange(true)) return;
    close_trigger_ = trigger;
    close_reason_ = why.ok() ? absl::UnavailableError("RDMA connection closed")
                             : std::move(why);
    // Tells the peer; the engine tears the queue pair down.
    if (res_.qp.get() != nullptr) rdma_disconnect(res_.id.get());
  }
  // Not added yet: the engine that adds it finds it closed (closed_ and
  // engine_ are sequentially consistent: this load or its adding sees the
  // other's store).
  if (Engine* engine = this->engine()) engine->WakeForClose();
}

Status Connection::InjectQueuePairError() {
  std::lock_guard<std::mutex> lock(mu_);
  if (res_.qp.get() == nullptr) return absl::OkStatus();
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  int rc = ibv_modify_qp(res_.qp.get(), &attr, IBV_QP_STATE);
  if (rc != 0) return VerbsError("ibv_modify_qp to the error state", rc);
  return absl::OkStatus();
}

bool Connection::AwaitLastSharedReceive() {
  if (res_.srq == nullptr || res_.qp.get() == nullptr ||
      last_wqe_reached_.load(std::memory_order_acquire)) {
    return true;
  }
  // A software device (rxe, siw) keeps a destroyed queue pair's
  // completions in the queue, where the drain after the destroy finds
  // them (and rxe before Linux 6.10 never reports the event).
  if (IsSoftwareDevice(res_.id->verbs)) return true;
  const auto now = internal::CoarseSteadyNow().time_since_epoch().count();
  if (last_wqe_wait_began_ == 0) {
    // rdma_disconnect moved it to the error state unless the connection
    // never got that far; either way it must be there for the event.
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    (void)ibv_modify_qp(res_.qp.get(), &attr, IBV_QP_STATE);
    last_wqe_wait_began_ = now;
  }
  if (now - last_wqe_wait_began_ <
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          kLastSharedReceiveWait)
          .count()) {
    return false;
  }
  ++last_wqe_waits_timed_out;
  // Given up: later passes (a caller held the group) go on at once.
  last_wqe_reached_.store(true, std::memory_order_release);
  return true;
}

void Connection::NoteLastSharedReceive() {
  last_wqe_reached_.store(true, std::memory_order_release);
}

uint64_t Connection::LastSharedReceiveWaitsTimedOut() {
  return last_wqe_waits_timed_out.load();
}

bool Connection::FinishClose() {
  if (finished_.load(std::memory_order_relaxed)) return true;
  // A queue pair on a shared receive queue may still complete a receive
  // it took from the queue; destroying it before would lose that buffer
  // from the pool (drivers discard the completions of a destroyed queue
  // pair): wait for the device to say it took its last.
  if (!AwaitLastSharedReceive()) return false;
  // A waiting caller may be polling the group: the engine comes back on
  // its next pass. What completed before the close still counts: a
  // response that arrived must not be re-sent by the client or reported
  // lost by the server. (The group's other connections' completions are
  // handled on the way.)
  CompletionGroup* group = res_.group.group();
  if (!group->TryTake()) return false;
  group->DrainHeld();
  finished_.store(true, std::memory_order_relaxed);
  std::vector<std::function<void(Status)>> pending;
  std::vector<WindowsReady> waiters;
  Status why = CloseReason();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A type-2 window still bound holds its queue pair (rxe then waits
    // 50 s to destroy it): the windows go first.
    windows_.clear();
    free_windows_.clear();
    for (WindowWaiter& w : window_waiters_)
      waiters.push_back(std::move(w.ready));
    window_waiters_.clear();
    // Their registrations deregister now; large ones take long (aside).
    std::vector<MemoryRegion> window_mrs = std::move(regions_under_windows_);
    for (Posted& posted : posted_) {
      if (posted.window_mr != nullptr) {
        window_mrs.push_back(std::move(posted.window_mr));
      }
    }
    DeregisterAside(std::move(window_mrs), shared_from_this());
    windows_unavailable_ = absl::UnavailableError("RDMA connection closed");
    // Unpinning up to the arena's limit takes long: aside, holding this
    // connection (and so its domain) until then. A shared domain's regions
    // stay with its group.
    if (own_arena_regions_ != nullptr) {
      own_arena_regions_->Drop(shared_from_this());
    }
    // Once the queue pair is gone the device no longer touches any memory
    // the pending work referenced, so the continuations may release it.
    {
      std::lock_guard<std::mutex> post_lock(post_mu_);
      res_.qp.Reset();
    }
    if (res_.send_pool != nullptr) ReturnBorrowedLocked();
    for (Posted& posted : posted_) {
      if (posted.done) pending.push_back(std::move(posted.done));
      posted = Posted{};
    }
    posted_count_ = 0;
    unsignaled_count_ = 0;
    group->RemoveAwaited(std::exchange(awaited_posted_, 0));
    for (auto& w : writes_) {
      if (w.done) pending.push_back(std::move(w.done));
    }
    for (auto& f : frames_) {
      if (f.sent) pending.push_back(std::move(f.sent));
    }
    group->RemoveAwaited(static_cast<int>(writes_.size() + frames_.size()));
    writes_.clear();
    frames_.clear();
    for (auto& f : unposted_) pending.push_back(std::move(f));
    unposted_.clear();
  }
  // The queue pair is gone: completions of it still in the group's queue
  // go nowhere. They are polled out now (none comes after the queue pair
  // is destroyed), so the entries this connection gives back when it
  // leaves the group are free for the next one.
  res_.group.Uninstall();
  group->DrainAfterDestroyHeld();
  group->GiveBack();
  for (auto& f : pending) f(why);
  std::shared_ptr<Handler> handler = std::move(handler_);
  handler->OnClosed(why);
  // After the handler: its calls waiting for windows are over already.
  for (WindowsReady& ready : waiters) ready(why, {});
  return true;
}

}  // namespace rdmarpc::rdma
