#include "transport/rdma/completion_group.h"

#include <fcntl.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rdmarpc/memory.h"
#include "runtime/spin.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

constexpr uint32_t kSlotMask = CompletionGroup::kMaxMembers - 1;
constexpr uint32_t kKeyMask =
    (uint32_t{1} << (CompletionGroup::kSlotBits +
                     CompletionGroup::kGenerationBits)) -
    1;
constexpr uint32_t kGenerationMask =
    (uint32_t{1} << CompletionGroup::kGenerationBits) - 1;

// The group this thread holds (TryTake), if any.
thread_local const CompletionGroup* held_group = nullptr;

// Whether the connections of a group on `device` share one protection
// domain: only where every landing can be granted through a type-2
// window of its own queue pair. GPU direct landings are still registered
// for remote write (windows over GPU memory were never tried on a
// device), so a process with a GPU keeps a domain per connection.
// RDMARPC_RDMA_SHARED_DOMAINS=0 keeps one per connection anywhere.
bool SharesDomain(ibv_context* device) {
  if (const char* env = std::getenv("RDMARPC_RDMA_SHARED_DOMAINS");
      env != nullptr && std::string_view(env) == "0") {
    return false;
  }
  ibv_device_attr attr{};
  return ibv_query_device(device, &attr) == 0 &&
         (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0 &&
         CudaDeviceCount() == 0;
}

// Whether a group's members, sharing its domain, also share a receive
// queue. RDMARPC_RDMA_SHARED_RECEIVES=0 gives each connection its own
// receives.
bool SharesReceives() {
  const char* env = std::getenv("RDMARPC_RDMA_SHARED_RECEIVES");
  return env == nullptr || std::string_view(env) != "0";
}

std::atomic<uint32_t> max_members_for_testing{0};

}  // namespace

CompletionGroup::Membership& CompletionGroup::Membership::operator=(
    Membership&& o) noexcept {
  if (this != &o) {
    Leave();
    group_ = std::move(o.group_);
    key_ = o.key_;
    entries_ = o.entries_;
    shared_receives_ = std::exchange(o.shared_receives_, false);
    qp_num_ = o.qp_num_;
  }
  return *this;
}

ibv_cq* CompletionGroup::Membership::cq() const {
  return group_ == nullptr ? nullptr : group_->cq();
}

void CompletionGroup::Membership::Install(Connection* conn, uint32_t qp_num) {
  if (shared_receives_) qp_num_ = qp_num;
  group_->Install(key_, conn, shared_receives_ ? qp_num : 0);
}

void CompletionGroup::Membership::Uninstall() {
  if (group_ != nullptr) group_->Uninstall(key_, qp_num_);
}

ibv_srq* CompletionGroup::Membership::TakeSharedReceives(uint32_t receive_bytes,
                                                         uint32_t first) {
  ibv_srq* srq = group_->TakeSharedReceives(key_, receive_bytes, first);
  shared_receives_ = srq != nullptr;
  return srq;
}

uint32_t CompletionGroup::Membership::AllotShared(uint32_t want) {
  return group_->AllotShared(key_, want);
}

SendPool* CompletionGroup::Membership::TakeSendPool(uint32_t frame_bytes) {
  return group_->TakeSendPool(frame_bytes);
}

void CompletionGroup::Membership::Leave() {
  if (group_ == nullptr) return;
  group_->Uninstall(key_, qp_num_);
  group_->Leave(key_, entries_);
  group_.reset();
}

void CompletionGroup::SetMaxMembersForTesting(int members) {
  max_members_for_testing.store(static_cast<uint32_t>(members));
}

StatusOr<std::shared_ptr<CompletionGroup>> CompletionGroup::Create(
    Engine* engine, ibv_context* device, bool serves, int entries, int epoll_fd,
    std::atomic<int>* members) {
  int capacity = kDefaultEntries;
  ibv_device_attr attr{};
  if (ibv_query_device(device, &attr) == 0 && attr.max_cqe > 0) {
    // With its spare third the queue stays within the device's limit.
    capacity = static_cast<int>(std::min<int64_t>(
        capacity, int64_t{attr.max_cqe} * kSpareDivisor / (kSpareDivisor + 1)));
  }
  int queue_entries = capacity + capacity / kSpareDivisor;
  if (entries > capacity) {
    // A connection that needs more has a queue of its own, of its size
    // (beyond the device's limit it fails below, naming the size).
    capacity = entries;
    queue_entries = entries;
  }
  std::shared_ptr<CompletionGroup> group(
      new CompletionGroup(engine, device, serves,
                          static_cast<uint32_t>(capacity), epoll_fd, members));
  errno = 0;
  group->channel_.reset(ibv_create_comp_channel(device));
  if (group->channel_ == nullptr) {
    return VerbsError("ibv_create_comp_channel", errno != 0 ? errno : EIO);
  }
  const int fd = group->channel_->fd;
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return VerbsError("making the completion channel non-blocking", errno);
  }
  RDMARPC_ASSIGN_OR_RETURN(
      group->cq_, CreateCq(device, queue_entries, group->channel_.get()));
  if (SharesDomain(device)) {
    RDMARPC_ASSIGN_OR_RETURN(group->pd_, AllocatePd(device));
    group->arena_regions_ = std::make_unique<ArenaRegions>(group->pd_.get());
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = group.get();
  if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return VerbsError("watching a completion channel (epoll_ctl)", errno);
  }
  return group;
}

CompletionGroup::CompletionGroup(Engine* engine, ibv_context* device,
                                 bool serves, uint32_t capacity, int epoll_fd,
                                 std::atomic<int>* members)
    : engine_(engine),
      device_(device),
      serves_(serves),
      capacity_(capacity),
      epoll_fd_(epoll_fd),
      engine_members_(members),
      slots_(new std::atomic<Connection*>[kMaxMembers]),
      generations_(kMaxMembers, 0),
      slot_allotted_(new std::atomic<uint32_t>[kMaxMembers]) {
  for (uint32_t i = 0; i < kMaxMembers; ++i) {
    slots_[i].store(nullptr);
    slot_allotted_[i].store(0);
  }
}

CompletionGroup::~CompletionGroup() {
  // Made but never joined (Create failed half-way): the last member did
  // not take the queue with it.
  if (channel_ != nullptr) {
    (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, channel_->fd, nullptr);
  }
}

bool CompletionGroup::TryJoin(uint32_t entries, Membership* member) {
  uint32_t key = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint32_t max_members = max_members_for_testing.load();
    if (closed_.load(std::memory_order_relaxed) ||
        broken_.load(std::memory_order_acquire) ||
        entries_taken_ + entries > capacity_ ||
        (max_members > 0 && members_ >= max_members)) {
      return false;
    }
    uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else if (next_unused_slot_ < kMaxMembers) {
      slot = next_unused_slot_++;
    } else {
      return false;
    }
    // Never 0: a send's work request id then could be 0, which the
    // connection's table of posted work reads as a free slot.
    uint32_t generation = ++generations_[slot] & kGenerationMask;
    if (generation == 0) generation = ++generations_[slot] & kGenerationMask;
    key = generation << kSlotBits | slot;
    ++members_;
    entries_taken_ += entries;
  }
  Membership joined;
  joined.group_ = shared_from_this();
  joined.key_ = key;
  joined.entries_ = entries;
  *member = std::move(joined);
  return true;
}

void CompletionGroup::Install(uint32_t key, Connection* conn,
                              uint32_t shared_qp_num) {
  if (shared_qp_num != 0) {
    // The map is the holder's: it takes the entry before its next poll
    // (or when a receive of this queue pair finds none).
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_members_.emplace_back(shared_qp_num, conn);
    members_pending_.store(true, std::memory_order_release);
  }
  slots_[key & kSlotMask].store(conn, std::memory_order_release);
}

void CompletionGroup::TakePendingMembersHeld() {
  if (installs_held_) return;
  std::lock_guard<std::mutex> lock(pending_mu_);
  for (const auto& [qp_num, conn] : pending_members_) {
    shared_members_[qp_num] = conn;
  }
  pending_members_.clear();
  members_pending_.store(false, std::memory_order_relaxed);
}

void CompletionGroup::Uninstall(uint32_t key, uint32_t shared_qp_num) {
  std::atomic<Connection*>& slot = slots_[key & kSlotMask];
  Connection* conn = slot.load(std::memory_order_relaxed);
  if (conn == nullptr) return;
  // With the group held, no completion is being handed to it.
  const bool took = TakeBlocking();
  slot.store(nullptr, std::memory_order_relaxed);
  if (shared_qp_num != 0) {
    if (members_pending_.load(std::memory_order_acquire)) {
      TakePendingMembersHeld();
    }
    // A later queue pair may have the number already: only its own entry.
    auto it = shared_members_.find(shared_qp_num);
    if (it != shared_members_.end() && it->second == conn) {
      shared_members_.erase(it);
    }
  }
  if (took) GiveBack();
}

SendPool* CompletionGroup::TakeSendPool(uint32_t frame_bytes) {
  if (pd_ == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_.load(std::memory_order_relaxed)) return nullptr;
  if (!send_pool_tried_) {
    send_pool_tried_ = true;
    const uint32_t buffers = SendPool::BuffersFromEnvironment();
    if (buffers == 0) return nullptr;
    // A member whose peer takes larger frames registers its own.
    auto pool = SendPool::Create(pd_.get(), buffers, frame_bytes);
    if (!pool.ok()) return nullptr;
    send_pool_ = *std::move(pool);
  }
  if (send_pool_ == nullptr || frame_bytes > send_pool_->buffer_bytes()) {
    return nullptr;
  }
  return send_pool_.get();
}

ibv_srq* CompletionGroup::TakeSharedReceives(uint32_t key,
                                             uint32_t receive_bytes,
                                             uint32_t first) {
  if (pd_ == nullptr || !SharesReceives()) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_.load(std::memory_order_relaxed)) return nullptr;
  if (srq_ == nullptr) {
    ibv_device_attr attr{};
    if (ibv_query_device(device_, &attr) != 0 || attr.max_srq_wr <= 0) {
      return nullptr;
    }
    const uint32_t capacity =
        std::min<uint32_t>(kMaxSharedReceives, attr.max_srq_wr) /
        kSharedChunkReceives * kSharedChunkReceives;
    if (capacity == 0) return nullptr;
    auto srq = CreateSrq(pd_.get(), capacity);
    if (!srq.ok()) return nullptr;
    srq_ = *std::move(srq);
    srq_capacity_ = capacity;
    srq_receive_bytes_ = receive_bytes;
    shared_chunks_.reset(
        new std::atomic<SharedChunk*>[capacity / kSharedChunkReceives]);
    for (uint32_t i = 0; i < capacity / kSharedChunkReceives; ++i) {
      shared_chunks_[i].store(nullptr);
    }
  }
  if (receive_bytes != srq_receive_bytes_) return nullptr;
  // The polling thread allots spare receives meanwhile: the pool grows
  // until `first` of them are this member's.
  uint32_t allotted = shared_allotted_.load(std::memory_order_acquire);
  for (;;) {
    if (SpareShared(allotted) < first) {
      if (!GrowSharedLocked().ok()) return nullptr;
      allotted = shared_allotted_.load(std::memory_order_acquire);
      continue;
    }
    if (shared_allotted_.compare_exchange_weak(allotted, allotted + first,
                                               std::memory_order_acq_rel)) {
      break;
    }
  }
  slot_allotted_[key & kSlotMask].store(first, std::memory_order_relaxed);
  return srq_.get();
}

uint32_t CompletionGroup::SpareShared(uint32_t allotted) const {
  const uint32_t usable = shared_receive_buffers();
  return usable > allotted ? usable - allotted : 0;
}

Status CompletionGroup::GrowSharedLocked() {
  Status grown = AddSharedChunkLocked();
  if (!grown.ok()) shared_growth_over_.store(true, std::memory_order_release);
  return grown;
}

Status CompletionGroup::AddSharedChunkLocked() {
  if ((next_chunk_ + 1) * kSharedChunkReceives > srq_capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the shared receive queue holds its ", srq_capacity_, " receives"));
  }
  const uint32_t first_index = next_chunk_ * kSharedChunkReceives;
  auto chunk = std::make_unique<SharedChunk>();
  const size_t bytes = size_t{kSharedChunkReceives} * srq_receive_bytes_;
  chunk->bytes = std::make_unique<uint8_t[]>(bytes);
  RDMARPC_ASSIGN_OR_RETURN(chunk->mr,
                           RegisterMemory(pd_.get(), chunk->bytes.get(), bytes,
                                          IBV_ACCESS_LOCAL_WRITE));
  shared_chunks_[next_chunk_++].store(chunk.get(), std::memory_order_release);
  owned_chunks_.push_back(std::move(chunk));
  for (uint32_t i = 0; i < kSharedChunkReceives; ++i) {
    // A buffer that cannot be posted is not counted: nothing is allotted
    // against it (and the queue is likely broken: no more are tried).
    RDMARPC_RETURN_IF_ERROR(PostShared(first_index + i));
    shared_total_.fetch_add(1, std::memory_order_acq_rel);
  }
  return absl::OkStatus();
}

void CompletionGroup::GrowSharedAside() {
  if (shared_growth_over_.load(std::memory_order_acquire)) return;
  if (growing_aside_.exchange(true, std::memory_order_acq_rel)) return;
  RunAside([self = shared_from_this()] {
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (!self->closed_.load(std::memory_order_relaxed)) {
        // Full, or a chunk that failed: grants stay as they are.
        (void)self->GrowSharedLocked();
      }
    }
    self->growing_aside_.store(false, std::memory_order_release);
  });
}

uint8_t* CompletionGroup::SharedReceiveBuffer(uint32_t index) const {
  SharedChunk* chunk = shared_chunks_[index / kSharedChunkReceives].load(
      std::memory_order_acquire);
  return chunk->bytes.get() +
         size_t{index % kSharedChunkReceives} * srq_receive_bytes_;
}

Status CompletionGroup::PostShared(uint32_t index) {
  SharedChunk* chunk = shared_chunks_[index / kSharedChunkReceives].load(
      std::memory_order_acquire);
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(SharedReceiveBuffer(index));
  sge.length = srq_receive_bytes_;
  sge.lkey = chunk->mr->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = kReceiveBit | index;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_srq_recv(srq_.get(), &wr, &bad);
  if (rc != 0) return VerbsError("ibv_post_srq_recv", rc);
  return absl::OkStatus();
}

Status CompletionGroup::RepostShared(uint32_t index) {
  Status posted = PostShared(index);
  if (!posted.ok()) {
    shared_reposts_failed_.fetch_add(1, std::memory_order_relaxed);
  }
  return posted;
}

uint32_t CompletionGroup::AllotShared(uint32_t key, uint32_t want) {
  uint32_t allotted = shared_allotted_.load(std::memory_order_acquire);
  uint32_t granted = 0;
  do {
    granted = std::min(want, SpareShared(allotted));
    if (granted == 0) break;
  } while (!shared_allotted_.compare_exchange_weak(allotted, allotted + granted,
                                                   std::memory_order_acq_rel));
  // Fewer spare than wanted: more for the next grant, registered aside.
  if (granted < want) GrowSharedAside();
  if (granted == 0) return 0;
  slot_allotted_[key & kSlotMask].fetch_add(granted, std::memory_order_relaxed);
  return granted;
}

void CompletionGroup::Leave(uint32_t key, uint32_t entries) {
  bool last = false;
  // The member's queue pair is gone: its peer's credits no longer need
  // receives of the pool.
  if (const uint32_t allotted = slot_allotted_[key & kSlotMask].exchange(
          0, std::memory_order_relaxed);
      allotted > 0) {
    shared_allotted_.fetch_sub(allotted, std::memory_order_acq_rel);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_slots_.push_back(key & kSlotMask);
    entries_taken_ -= entries;
    last = --members_ == 0;
    if (last) closed_.store(true, std::memory_order_release);
  }
  engine_members_->fetch_sub(1);
  if (!last) return;
  // Nothing joins a closed group. The queue goes with the group held, so
  // no thread polls or arms it meanwhile (whoever takes it next sees it
  // closed).
  const bool held = HeldHere();
  if (!held) {
    while (polling_.exchange(true, std::memory_order_acquire)) {
      internal::CpuRelax();
    }
  }
  // An error only means the fd is gone already.
  (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, channel_->fd, nullptr);
  AckEventsHeld();  // destroying the queue waits for every ack
  cq_.reset();
  channel_.reset();
  // Every member's queue pair and regions went before its membership; the
  // shared receives go before the domain.
  srq_.reset();
  owned_chunks_.clear();
  send_pool_.reset();  // the members' queue pairs went before
  // The arena's regions here (after a registration running aside ends):
  // the members' windows over them went with their connections. Unpinned
  // on this thread, which stalls for it (milliseconds per 16 MiB segment,
  // once per group): handing them aside would need the domain and the
  // device's context kept past the last member, whose CM id frees a
  // removed device's context.
  if (arena_regions_ != nullptr) arena_regions_->Drop(nullptr);
  pd_.reset();
  released_.store(true, std::memory_order_release);
  if (!held) polling_.store(false, std::memory_order_release);
}

bool CompletionGroup::HeldHere() const { return held_group == this; }

bool CompletionGroup::TryTake() {
  if (polling_.exchange(true, std::memory_order_acquire)) return false;
  if (closed_.load(std::memory_order_acquire)) {
    polling_.store(false, std::memory_order_release);
    return false;
  }
  held_before_ = held_group;
  held_group = this;
  return true;
}

bool CompletionGroup::TakeBlocking() {
  if (HeldHere()) return false;
  while (polling_.exchange(true, std::memory_order_acquire)) {
    internal::CpuRelax();
  }
  held_before_ = held_group;
  held_group = this;
  return true;
}

void CompletionGroup::Release() {
  held_group = held_before_;
  polling_.store(false, std::memory_order_release);
}

void CompletionGroup::GiveBack() {
  held_group = held_before_;
  polling_.store(false, std::memory_order_seq_cst);
  WakeEngineIfUnwatched();
}

void CompletionGroup::WakeEngineIfUnwatched() {
  // A holder (a caller polling for its call) wakes it, if need be, when it
  // gives the group back.
  if (HeldHere()) return;
  if (unarmed_.load(std::memory_order_seq_cst) &&
      awaited_.load(std::memory_order_seq_cst) > 0 &&
      unarmed_.exchange(false, std::memory_order_seq_cst)) {
    engine_->Wake();
  }
}

int CompletionGroup::PollHeld() {
  if (members_pending_.load(std::memory_order_acquire)) {
    TakePendingMembersHeld();
  }
  ibv_wc wcs[kPollBatch];
  const int n = ibv_poll_cq(cq_.get(), kPollBatch, wcs);
  if (n < 0) {
    // The queue is broken: so is every connection on it.
    MarkBroken();
    for (uint32_t i = 0; i < kMaxMembers; ++i) {
      if (Connection* c = slots_[i].load(std::memory_order_acquire)) {
        c->Close(absl::UnavailableError(
                     "RDMA connection failed: ibv_poll_cq failed"),
                 "work-completion error");
      }
    }
    return 0;
  }
  for (int i = 0; i < n; ++i) Dispatch(wcs[i]);
  return n;
}

void CompletionGroup::Dispatch(const ibv_wc& wc) {
  const uint32_t key = static_cast<uint32_t>(wc.wr_id >> kKeyShift) & kKeyMask;
  if (key == 0) return DispatchShared(wc);
  Connection* conn = slots_[key & kSlotMask].load(std::memory_order_acquire);
  // Null or another key: the connection that posted it is gone (its queue
  // pair's last completions, left behind by its close).
  if (conn != nullptr && conn->member_key() == key) conn->OnCompletion(wc);
}

void CompletionGroup::DispatchShared(const ibv_wc& wc) {
  const auto index = static_cast<uint32_t>(wc.wr_id & kLocalMask);
  auto it = shared_members_.find(wc.qp_num);
  if (it == shared_members_.end() &&
      members_pending_.load(std::memory_order_acquire)) {
    TakePendingMembersHeld();
    it = shared_members_.find(wc.qp_num);
  }
  // The member re-posts the buffer itself (before it returns the credit);
  // otherwise (it failed, closed, or has gone) it goes back here.
  if (it != shared_members_.end() && it->second->OnCompletion(wc)) return;
  (void)RepostShared(index);
}

void CompletionGroup::DrainAfterDestroyHeld() {
  installs_held_ = true;
  DrainHeld();
  installs_held_ = false;
}

void CompletionGroup::DrainHeld() {
  const uint32_t rounds = capacity_ / kPollBatch + 1;
  for (uint32_t i = 0; i < rounds && PollHeld() == kPollBatch; ++i) {
  }
}

CompletionGroup::PollResult CompletionGroup::TryPoll() {
  if (!TryTake()) return closed() ? PollResult::kIdle : PollResult::kBusy;
  const int found = PollHeld();
  Release();
  return found > 0 ? PollResult::kFound : PollResult::kIdle;
}

bool CompletionGroup::ArmForSleep() {
  if (!serves_) {
    // Marked first: a call that starts after the load below finds the
    // mark and wakes the engine, and so does a holder that gives the group
    // back after the load of polling_ with a call awaiting.
    unarmed_.store(true, std::memory_order_seq_cst);
    if (awaited_.load(std::memory_order_seq_cst) == 0 ||
        polling_.load(std::memory_order_seq_cst)) {
      return true;
    }
  }
  // A client group taken meanwhile is its holder's to hand back (marked).
  if (!TryTake()) return closed() || !serves_;
  unarmed_.store(false, std::memory_order_relaxed);
  ibv_req_notify_cq(cq_.get(), 0);
  arms_.fetch_add(1, std::memory_order_relaxed);
  // An arm raises no event for what came before it. Polled under the same
  // hold: a thread that took the group next might not poll it all, and
  // finding it unmarked it would wake no one.
  const int found = PollHeld();
  Release();
  return found == 0;
}

void CompletionGroup::ConsumeEvents() {
  if (!TryTake()) return;
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  // One event per arm, and the engine arms once per sleep: one read
  // suffices (epoll reports the fd again if more are queued).
  if (ibv_get_cq_event(channel_.get(), &cq, &context) == 0 &&
      ++unacked_events_ >= kEventAckBatch) {
    AckEventsHeld();
  }
  Release();
}

void CompletionGroup::AckEventsHeld() {
  if (unacked_events_ == 0) return;
  ibv_ack_cq_events(cq_.get(), unacked_events_);
  unacked_events_ = 0;
}

}  // namespace rdmarpc::rdma
