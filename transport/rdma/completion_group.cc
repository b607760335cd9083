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

std::atomic<uint32_t> max_members_for_testing{0};

}  // namespace

CompletionGroup::Membership& CompletionGroup::Membership::operator=(
    Membership&& o) noexcept {
  if (this != &o) {
    Leave();
    group_ = std::move(o.group_);
    key_ = o.key_;
    entries_ = o.entries_;
  }
  return *this;
}

ibv_cq* CompletionGroup::Membership::cq() const {
  return group_ == nullptr ? nullptr : group_->cq();
}

void CompletionGroup::Membership::Install(Connection* conn) {
  group_->Install(key_, conn);
}

void CompletionGroup::Membership::Uninstall() {
  if (group_ != nullptr) group_->Uninstall(key_);
}

void CompletionGroup::Membership::Leave() {
  if (group_ == nullptr) return;
  group_->Uninstall(key_);
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
      generations_(kMaxMembers, 0) {
  for (uint32_t i = 0; i < kMaxMembers; ++i) slots_[i].store(nullptr);
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

void CompletionGroup::Install(uint32_t key, Connection* conn) {
  slots_[key & kSlotMask].store(conn, std::memory_order_release);
}

void CompletionGroup::Uninstall(uint32_t key) {
  std::atomic<Connection*>& slot = slots_[key & kSlotMask];
  if (slot.load(std::memory_order_relaxed) == nullptr) return;
  // With the group held, no completion is being handed to it.
  const bool held = HeldHere();
  if (!held) {
    while (polling_.exchange(true, std::memory_order_acquire)) {
      internal::CpuRelax();
    }
  }
  slot.store(nullptr, std::memory_order_relaxed);
  if (!held) polling_.store(false, std::memory_order_release);
}

void CompletionGroup::Leave(uint32_t key, uint32_t entries) {
  bool last = false;
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
  cq_.reset();
  channel_.reset();
  // Every member's queue pair and regions went before its membership.
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

void CompletionGroup::GiveBack() {
  held_group = held_before_;
  polling_.store(false, std::memory_order_release);
}

int CompletionGroup::PollHeld() {
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
  Connection* conn = slots_[key & kSlotMask].load(std::memory_order_acquire);
  // Null or another key: the connection that posted it is gone (its queue
  // pair's last completions, left behind by its close).
  if (conn != nullptr && conn->member_key() == key) conn->OnCompletion(wc);
}

void CompletionGroup::DrainHeld() {
  const uint32_t rounds = capacity_ / kPollBatch + 1;
  for (uint32_t i = 0; i < rounds && PollHeld() == kPollBatch; ++i) {
  }
}

CompletionGroup::PollResult CompletionGroup::TryPoll() {
  if (!TryTake()) return closed() ? PollResult::kIdle : PollResult::kBusy;
  const int found = PollHeld();
  GiveBack();
  return found > 0 ? PollResult::kFound : PollResult::kIdle;
}

bool CompletionGroup::Arm() {
  if (!TryTake()) return closed();
  ibv_req_notify_cq(cq_.get(), 0);
  GiveBack();
  return true;
}

void CompletionGroup::ConsumeEvents() {
  if (!TryTake()) return;
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  // One event per Arm(), and the engine arms once per sleep: one read
  // suffices (epoll reports the fd again if more are queued).
  if (ibv_get_cq_event(channel_.get(), &cq, &context) == 0) {
    ibv_ack_cq_events(cq, 1);
  }
  GiveBack();
}

}  // namespace rdmarpc::rdma
