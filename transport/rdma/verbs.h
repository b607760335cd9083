// Ownership and errors for libibverbs and librdmacm objects.
//
// Every verbs object the transport creates lives in one of the RAII handles
// below, so that an early return never leaks a queue pair or a registration,
// and destruction order is the reverse of creation (declare handles in
// creation order). Errors come back as absl::Status with canonical codes and
// a message that says what to do.
//
//   RDMARPC_ASSIGN_OR_RETURN(EventChannel events, CreateEventChannel());
//   RDMARPC_ASSIGN_OR_RETURN(CmId id, CreateCmId(events.get()));
//   RDMARPC_ASSIGN_OR_RETURN(ProtectionDomain pd, AllocatePd(id->verbs));
//   RDMARPC_ASSIGN_OR_RETURN(MemoryRegion mr,
//                            RegisterMemory(pd.get(), buf, len, kAccess));
#ifndef RDMARPC_TRANSPORT_RDMA_VERBS_H_
#define RDMARPC_TRANSPORT_RDMA_VERBS_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "rdmarpc/status.h"

namespace rdmarpc::rdma {

// Calls `Destroy` on a non-null pointer; the return code of a destroy call
// has nothing left to act on.
template <auto Destroy>
struct VerbsDeleter {
  template <typename T>
  void operator()(T* p) const {
    if (p != nullptr) (void)Destroy(p);
  }
};

using DeviceList =
    std::unique_ptr<ibv_device*, VerbsDeleter<ibv_free_device_list>>;
using DeviceContext =
    std::unique_ptr<ibv_context, VerbsDeleter<ibv_close_device>>;
using EventChannel = std::unique_ptr<rdma_event_channel,
                                     VerbsDeleter<rdma_destroy_event_channel>>;
// An event channel that every id on it keeps open: destroying an id whose
// channel is gone fails, and librdmacm then leaks the id.
using SharedEventChannel = std::shared_ptr<rdma_event_channel>;
// Destroys the id; a queue pair made on it must go first (CmQueuePair).
using CmId = std::unique_ptr<rdma_cm_id, VerbsDeleter<rdma_destroy_id>>;
// Deallocates; a refusal (something of the domain left, a region say)
// leaks it, reported on stderr.
struct ProtectionDomainDeleter {
  void operator()(ibv_pd* pd) const;
};
using ProtectionDomain = std::unique_ptr<ibv_pd, ProtectionDomainDeleter>;
using CompletionChannel =
    std::unique_ptr<ibv_comp_channel, VerbsDeleter<ibv_destroy_comp_channel>>;
using CompletionQueue = std::unique_ptr<ibv_cq, VerbsDeleter<ibv_destroy_cq>>;
using SharedReceiveQueue =
    std::unique_ptr<ibv_srq, VerbsDeleter<ibv_destroy_srq>>;
// Deregisters; a refusal (a type-2 window still bound over the region,
// say) leaves the pages pinned for the process's life, so it is counted
// (FailedDeregistrations) and reported on stderr.
struct MemoryRegionDeleter {
  void operator()(ibv_mr* mr) const;
};
using MemoryRegion = std::unique_ptr<ibv_mr, MemoryRegionDeleter>;
// Deregistrations the device refused, over the process's life.
uint64_t FailedDeregistrations();
// ibv_dealloc_mw is a static inline function: wrapped, so the handle's
// type has external linkage.
struct MemoryWindowDeleter {
  void operator()(ibv_mw* mw) const {
    if (mw != nullptr) (void)ibv_dealloc_mw(mw);
  }
};
using MemoryWindow = std::unique_ptr<ibv_mw, MemoryWindowDeleter>;

// A queue pair created on a CM id with rdma_create_qp, destroyed with
// rdma_destroy_qp. The id must outlive it.
class CmQueuePair {
 public:
  CmQueuePair() = default;
  explicit CmQueuePair(rdma_cm_id* id) : id_(id) {}
  CmQueuePair(CmQueuePair&& other) noexcept : id_(other.id_) {
    other.id_ = nullptr;
  }
  CmQueuePair& operator=(CmQueuePair&& other) noexcept;
  CmQueuePair(const CmQueuePair&) = delete;
  CmQueuePair& operator=(const CmQueuePair&) = delete;
  ~CmQueuePair() { Reset(); }

  ibv_qp* get() const { return id_ == nullptr ? nullptr : id_->qp; }
  ibv_qp* operator->() const { return get(); }
  void Reset();

 private:
  rdma_cm_id* id_ = nullptr;
};

// Status for a failed verbs/CM call that set errno (or returned it):
// "what: strerror (errno N)" with a canonical code for the errno.
[[nodiscard]] Status VerbsError(absl::string_view what, int err);

// A non-blocking CM event channel: NextCmEvent polls it.
[[nodiscard]] StatusOr<EventChannel> CreateEventChannel();
[[nodiscard]] StatusOr<CmId> CreateCmId(rdma_event_channel* events,
                                        void* context = nullptr);
[[nodiscard]] StatusOr<ProtectionDomain> AllocatePd(ibv_context* device);
[[nodiscard]] StatusOr<CompletionQueue> CreateCq(
    ibv_context* device, int entries, ibv_comp_channel* channel = nullptr);
// A shared receive queue of `max_wr` single-buffer receives.
[[nodiscard]] StatusOr<SharedReceiveQueue> CreateSrq(ibv_pd* pd,
                                                     uint32_t max_wr);

// Registers [addr, addr + length) for `access`. On failure the message names
// the cause a user can fix: with ENOMEM/EPERM/EAGAIN it reports the
// locked-memory limit (RLIMIT_MEMLOCK) and says to raise `ulimit -l`.
[[nodiscard]] StatusOr<MemoryRegion> RegisterMemory(ibv_pd* pd, void* addr,
                                                    size_t length, int access);

// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  ~UniqueFd() { Reset(); }
  int get() const { return fd_; }
  void Reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Creates an RC queue pair on `id` (which has a device: resolved or
// accepted). Send and receive completions both go to `cq`.
struct QpCaps {
  uint32_t max_send_wr = 64;
  uint32_t max_recv_wr = 64;
  uint32_t max_send_sge = 1;
  uint32_t max_recv_sge = 1;
  uint32_t max_inline_data = 0;
  // Receives come from this shared queue (max_recv_wr is then ignored).
  ibv_srq* srq = nullptr;
};
[[nodiscard]] StatusOr<CmQueuePair> CreateRcQp(rdma_cm_id* id, ibv_pd* pd,
                                               ibv_cq* cq, const QpCaps& caps);

// The next CM event on `events`, which must be `expected`, within `timeout`.
// The event is acknowledged before returning; what callers need from it is
// copied out. An unexpected event (REJECTED, ADDR_ERROR, ...) is an error
// naming it, with the peer's reject status when there is one; one the CM's
// own timeout caused (status -ETIMEDOUT) is DEADLINE_EXCEEDED.
struct CmEvent {
  rdma_cm_event_type type;
  rdma_cm_id* id = nullptr;  // For CONNECT_REQUEST: the new id (owned by
                             // the caller from here on).
  rdma_cm_id* listen_id = nullptr;
  std::string private_data;  // Copied; the event's buffer dies on ack.
  int status = 0;
};
// The next CM event of any type within `timeout` (DEADLINE_EXCEEDED if
// none; UNAVAILABLE if one was reported and went with its id),
// acknowledged, with `status` holding the event's status field.
// CONNECT_REQUEST ids are the caller's to accept or reject and destroy.
[[nodiscard]] StatusOr<CmEvent> NextCmEvent(rdma_event_channel* events,
                                            std::chrono::milliseconds timeout);
[[nodiscard]] StatusOr<CmEvent> WaitCmEvent(rdma_event_channel* events,
                                            rdma_cm_event_type expected,
                                            std::chrono::milliseconds timeout);

// Polls `cq` until one completion arrives or `timeout` passes. A completion
// with an error status is returned as an error naming ibv_wc_status_str.
[[nodiscard]] StatusOr<ibv_wc> PollOne(ibv_cq* cq,
                                       std::chrono::milliseconds timeout);

// The first local IPv4 address that librdmacm binds to an RDMA device with an
// ACTIVE port: RDMARPC_RDMA_ADDR if set, else every interface address in
// turn. NOT_FOUND says how to fix it.
[[nodiscard]] StatusOr<std::string> FindRdmaIpv4Address();

// Lets librdmacm notice devices that went away (an rxe link deleted, a
// driver reset) and close its handle on them, which the kernel waits for
// before it can finish removing the device; also picks up devices that
// appeared. Call once this process has destroyed its ids on a removed
// device.
void ForgetRemovedRdmaDevices();

// Whether `device` is a software device (soft-RoCE rxe, soft-iWARP siw),
// told by its vendor id. Their ibv_post_send moves a write's bytes before it
// returns, where a NIC's only rings a doorbell.
bool IsSoftwareDevice(ibv_context* device);

// "rxe0 port 1 active mtu 4096" for each device and port; empty when there
// is no RDMA device.
std::vector<std::string> DescribeRdmaDevices();

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_VERBS_H_
