#include "transport/rdma/verbs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {
namespace {

std::string LimitText(rlim_t limit) {
  if (limit == RLIM_INFINITY) return "unlimited";
  if (limit >= (1u << 20) && limit % (1u << 20) == 0) {
    return absl::StrCat(limit >> 20, " MB");
  }
  return absl::StrCat(limit >> 10, " KB");
}

int LastErrno(int fallback = EIO) { return errno != 0 ? errno : fallback; }

std::atomic<uint64_t> failed_deregistrations{0};

}  // namespace

void MemoryRegionDeleter::operator()(ibv_mr* mr) const {
  if (mr == nullptr) return;
  const size_t length = mr->length;
  if (int rc = ibv_dereg_mr(mr); rc != 0) {
    failed_deregistrations.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr,
                 "rdmarpc: ibv_dereg_mr of a %zu-byte region failed: %s "
                 "(errno %d); its pages stay pinned\n",
                 length, std::strerror(rc), rc);
  }
}

void ProtectionDomainDeleter::operator()(ibv_pd* pd) const {
  if (pd == nullptr) return;
  if (int rc = ibv_dealloc_pd(pd); rc != 0) {
    std::fprintf(stderr,
                 "rdmarpc: ibv_dealloc_pd failed: %s (errno %d); the "
                 "protection domain and what is left in it leak\n",
                 std::strerror(rc), rc);
  }
}

uint64_t FailedDeregistrations() {
  return failed_deregistrations.load(std::memory_order_relaxed);
}

CmQueuePair& CmQueuePair::operator=(CmQueuePair&& other) noexcept {
  if (this != &other) {
    Reset();
    id_ = other.id_;
    other.id_ = nullptr;
  }
  return *this;
}

void CmQueuePair::Reset() {
  if (id_ != nullptr && id_->qp != nullptr) rdma_destroy_qp(id_);
  id_ = nullptr;
}

Status VerbsError(absl::string_view what, int err) {
  return absl::ErrnoToStatus(
      err, absl::StrCat(what, ": ", std::strerror(err), " (errno ", err, ")"));
}

StatusOr<EventChannel> CreateEventChannel() {
  errno = 0;
  EventChannel channel(rdma_create_event_channel());
  if (channel == nullptr) {
    int err = LastErrno(ENODEV);
    return absl::UnavailableError(absl::StrCat(
        "cannot open the RDMA connection manager (rdma_create_event_channel: ",
        std::strerror(err),
        "): is the rdma_ucm module loaded and /dev/infiniband/rdma_cm "
        "accessible?"));
  }
  // Non-blocking: an event that poll() reported is gone again when its id
  // is destroyed meanwhile, and a blocking rdma_get_cm_event would then
  // wait in the kernel for the next event, out of reach of a stop request
  // (seen: a server's listener thread, and so its shutdown, hung there).
  int flags = fcntl(channel->fd, F_GETFL);
  if (flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return VerbsError("making the RDMA CM event channel non-blocking", errno);
  }
  return channel;
}

StatusOr<CmId> CreateCmId(rdma_event_channel* events, void* context) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(events, &id, context, RDMA_PS_TCP) != 0) {
    return VerbsError("rdma_create_id", LastErrno());
  }
  return CmId(id);
}

StatusOr<ProtectionDomain> AllocatePd(ibv_context* device) {
  errno = 0;
  ProtectionDomain pd(ibv_alloc_pd(device));
  if (pd == nullptr) return VerbsError("ibv_alloc_pd", LastErrno());
  return pd;
}

StatusOr<SharedReceiveQueue> CreateSrq(ibv_pd* pd, uint32_t max_wr) {
  ibv_srq_init_attr attr{};
  attr.attr.max_wr = max_wr;
  attr.attr.max_sge = 1;
  errno = 0;
  SharedReceiveQueue srq(ibv_create_srq(pd, &attr));
  if (srq == nullptr) {
    return VerbsError(absl::StrCat("ibv_create_srq(", max_wr, " receives)"),
                      LastErrno());
  }
  return srq;
}

StatusOr<CompletionQueue> CreateCq(ibv_context* device, int entries,
                                   ibv_comp_channel* channel) {
  errno = 0;
  CompletionQueue cq(ibv_create_cq(device, entries, nullptr, channel, 0));
  if (cq == nullptr) {
    return VerbsError(absl::StrCat("ibv_create_cq(", entries, " entries)"),
                      LastErrno());
  }
  return cq;
}

StatusOr<MemoryRegion> RegisterMemory(ibv_pd* pd, void* addr, size_t length,
                                      int access) {
  errno = 0;
  MemoryRegion mr(ibv_reg_mr(pd, addr, length, access));
  if (mr != nullptr) return mr;
  int err = LastErrno(ENOMEM);
  std::string what = absl::StrCat("memory registration of ", length,
                                  " bytes failed: ", std::strerror(err));
  if (err == ENOMEM || err == EPERM || err == EAGAIN) {
    rlimit limit{};
    getrlimit(RLIMIT_MEMLOCK, &limit);
    if (limit.rlim_cur != RLIM_INFINITY) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, "; the locked-memory limit is ", LimitText(limit.rlim_cur),
          ", raise `ulimit -l` (e.g. `ulimit -l unlimited`, or memlock in "
          "/etc/security/limits.conf, or LimitMEMLOCK= for a systemd "
          "service)"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        what,
        " with no locked-memory limit: the device or the machine is "
        "out of memory it can pin"));
  }
  return absl::ErrnoToStatus(err, what);
}

StatusOr<CmQueuePair> CreateRcQp(rdma_cm_id* id, ibv_pd* pd, ibv_cq* cq,
                                 const QpCaps& caps) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq;
  attr.recv_cq = cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = caps.max_send_wr;
  attr.cap.max_recv_wr = caps.srq == nullptr ? caps.max_recv_wr : 0;
  attr.srq = caps.srq;
  attr.cap.max_send_sge = caps.max_send_sge;
  attr.cap.max_recv_sge = caps.max_recv_sge;
  attr.cap.max_inline_data = caps.max_inline_data;
  attr.sq_sig_all = 0;
  if (rdma_create_qp(id, pd, &attr) != 0) {
    return VerbsError(absl::StrCat("rdma_create_qp(send ", caps.max_send_wr,
                                   ", recv ", caps.max_recv_wr, ")"),
                      LastErrno());
  }
  return CmQueuePair(id);
}

StatusOr<CmEvent> NextCmEvent(rdma_event_channel* events,
                              std::chrono::milliseconds timeout) {
  pollfd pfd{events->fd, POLLIN, 0};
  int ready = poll(&pfd, 1, static_cast<int>(timeout.count()));
  if (ready < 0) return VerbsError("poll on the CM event channel", errno);
  if (ready == 0) {
    return absl::DeadlineExceededError(
        absl::StrCat("no CM event within ", timeout.count(), " ms"));
  }
  rdma_cm_event* event = nullptr;
  errno = 0;
  if (rdma_get_cm_event(events, &event) != 0) {
    int err = LastErrno();
    if (err == EAGAIN || err == EWOULDBLOCK) {
      // Reported, then dropped with its id (CreateEventChannel): no
      // timeout ran out.
      return absl::UnavailableError("the CM event went with its id");
    }
    return VerbsError("rdma_get_cm_event", err);
  }
  CmEvent out{event->event, event->id, event->listen_id, {}, event->status};
  if (event->param.conn.private_data != nullptr &&
      event->param.conn.private_data_len > 0 &&
      (event->event == RDMA_CM_EVENT_CONNECT_REQUEST ||
       event->event == RDMA_CM_EVENT_ESTABLISHED ||
       event->event == RDMA_CM_EVENT_REJECTED)) {
    out.private_data.assign(
        static_cast<const char*>(event->param.conn.private_data),
        event->param.conn.private_data_len);
  }
  rdma_ack_cm_event(event);
  return out;
}

StatusOr<CmEvent> WaitCmEvent(rdma_event_channel* events,
                              rdma_cm_event_type expected,
                              std::chrono::milliseconds timeout) {
  auto next = NextCmEvent(events, timeout);
  if (!next.ok()) {
    if (next.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return next.status();
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "no ", rdma_event_str(expected), " within ", timeout.count(), " ms"));
  }
  CmEvent out = *std::move(next);
  if (out.type != expected && out.type == RDMA_CM_EVENT_CONNECT_REQUEST) {
    // Nobody will own the new id: refuse the peer and free it.
    rdma_reject(out.id, nullptr, 0);
    rdma_destroy_id(out.id);
    out.id = nullptr;
  }
  if (out.type != expected && out.status == -ETIMEDOUT &&
      (out.type == RDMA_CM_EVENT_ADDR_ERROR ||
       out.type == RDMA_CM_EVENT_ROUTE_ERROR ||
       out.type == RDMA_CM_EVENT_UNREACHABLE)) {
    // The CM's own timeout (the budget's rest, given to the resolve calls,
    // or its connect retries) ran out: a timeout, not a refusal.
    return absl::DeadlineExceededError(
        absl::StrCat("no ", rdma_event_str(expected), ": ",
                     rdma_event_str(out.type), " (timed out)"));
  }
  if (out.type != expected) {
    std::string detail;
    if (out.type == RDMA_CM_EVENT_REJECTED) {
      detail = absl::StrCat(" (reject status ", out.status, ")");
    } else if (out.status != 0) {
      detail = absl::StrCat(" (status ", out.status, ")");
    }
    return absl::UnavailableError(
        absl::StrCat("expected ", rdma_event_str(expected), ", got ",
                     rdma_event_str(out.type), detail));
  }
  return out;
}

StatusOr<ibv_wc> PollOne(ibv_cq* cq, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  ibv_wc wc{};
  while (true) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) return VerbsError("ibv_poll_cq", EIO);
    if (n == 1) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no completion within ", timeout.count(), " ms"));
    }
    std::this_thread::yield();
  }
  if (wc.status != IBV_WC_SUCCESS) {
    return absl::UnavailableError(absl::StrCat(
        "work request ", wc.wr_id, " completed with ",
        ibv_wc_status_str(wc.status), " (vendor error ", wc.vendor_err, ")"));
  }
  return wc;
}

StatusOr<std::string> FindRdmaIpv4Address() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("RDMARPC_RDMA_ADDR"); env && *env) {
    candidates.push_back(env);
  } else {
    ifaddrs* addrs = nullptr;
    if (getifaddrs(&addrs) != 0) return VerbsError("getifaddrs", errno);
    for (ifaddrs* a = addrs; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN];
      auto* in = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
      if (ntohl(in->sin_addr.s_addr) >> 24 == 127) continue;  // loopback
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      candidates.push_back(text);
    }
    freeifaddrs(addrs);
  }
  RDMARPC_ASSIGN_OR_RETURN(EventChannel events, CreateEventChannel());
  for (const std::string& candidate : candidates) {
    auto id = CreateCmId(events.get());
    if (!id.ok()) return id.status();
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    if (inet_pton(AF_INET, candidate.c_str(), &sin.sin_addr) != 1) continue;
    if (rdma_bind_addr(id->get(), reinterpret_cast<sockaddr*>(&sin)) != 0) {
      continue;
    }
    ibv_context* device = (*id)->verbs;
    if (device == nullptr) continue;
    ibv_port_attr port{};
    if (ibv_query_port(device, (*id)->port_num, &port) == 0 &&
        port.state == IBV_PORT_ACTIVE) {
      return candidate;
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "no local IPv4 address belongs to an RDMA device with an ACTIVE port "
      "(tried ",
      candidates.size(),
      " addresses); run through tests/rdma_vm/run.sh for a soft-RoCE "
      "device, or set RDMARPC_RDMA_ADDR"));
}

void ForgetRemovedRdmaDevices() {
  // rdma_get_devices re-reads the device list; rdma_free_devices then
  // closes the contexts of devices that are gone and no longer used.
  if (ibv_context** list = rdma_get_devices(nullptr)) rdma_free_devices(list);
}

bool IsSoftwareDevice(ibv_context* device) {
  // The vendor ids the kernel's rxe and siw drivers report.
  constexpr uint32_t kRxeVendorId = 0xffffff;
  constexpr uint32_t kSiwVendorId = 0x626d74;
  ibv_device_attr attr{};
  if (ibv_query_device(device, &attr) != 0) return false;
  return attr.vendor_id == kRxeVendorId || attr.vendor_id == kSiwVendorId;
}

std::vector<std::string> DescribeRdmaDevices() {
  std::vector<std::string> out;
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) return out;
  for (int i = 0; i < count; ++i) {
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0) {
      for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr port{};
        if (ibv_query_port(ctx, p, &port) != 0) continue;
        out.push_back(absl::StrCat(ibv_get_device_name(list[i]), " port ", p,
                                   " ", ibv_port_state_str(port.state), " mtu ",
                                   128 << port.active_mtu));
      }
    }
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
  return out;
}

}  // namespace rdmarpc::rdma
