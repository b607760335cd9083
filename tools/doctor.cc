#include "tools/doctor.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <rdma/rdma_cma.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "rdmarpc/memory.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/gpu_registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::tools {
namespace {

using rdma::DeviceContext;
using rdma::DeviceList;

constexpr char kSoftRoceFix[] =
    "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, ...); without an "
    "RDMA NIC, soft-RoCE gives one over any Ethernet port: `modprobe "
    "rdma_rxe && rdma link add rxe0 type rxe netdev eth0` (calls go over "
    "gRPC/TCP until then)";

std::string ReadSysfs(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string Bytes(uint64_t n) {
  if (n >= (uint64_t{1} << 30) && n % (uint64_t{1} << 30) == 0) {
    return absl::StrCat(n >> 30, " GiB");
  }
  if (n >= (uint64_t{1} << 20)) return absl::StrCat(n >> 20, " MiB");
  return absl::StrCat(n >> 10, " KiB");
}

int MtuBytes(ibv_mtu mtu) { return 128 << mtu; }

const char* PortState(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "ACTIVE_DEFER";
    default:
      return "NOP";
  }
}

// Whether this process may lock memory past RLIMIT_MEMLOCK (CAP_IPC_LOCK,
// bit 14 of the effective capabilities).
bool HasIpcLock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    return (caps >> 14) & 1;
  }
  return false;
}

class Doctor {
 public:
  explicit Doctor(const DoctorOptions& options) : options_(options) {}

  DoctorReport Run() {
    out_ << "rdmarpc doctor: this host as rdmarpc sees it\n";
    const bool active_port = Devices();
    const bool address = Address(active_port);
    LockedMemory();
    Gpus();
    bool peer_ok = true;
    if (!options_.peer.empty()) peer_ok = Peer(active_port);

    report_.rdma_usable = active_port && address && peer_ok;
    out_ << "\nVerdict: ";
    if (report_.rdma_usable) {
      out_ << "calls between rdmarpc peers take RDMA when the other side "
              "offers it too"
           << (options_.peer.empty() ? "" : ", and rdma_cm reaches the peer")
           << ".\n";
    } else if (active_port && address) {
      out_ << "calls between this host and " << options_.peer
           << " go over gRPC/TCP: " << blocker_ << ".\n";
    } else {
      out_ << "calls from and to this host go over gRPC/TCP: "
           << (blocker_.empty() ? "no usable RDMA port (see above)" : blocker_)
           << ".\n";
    }
    if (report_.problems.empty()) {
      out_ << "No problems found.\n";
    } else {
      out_ << "\nProblems (" << report_.problems.size() << "):\n";
      for (const std::string& p : report_.problems) out_ << "  - " << p << "\n";
    }
    report_.text = out_.str();
    return report_;
  }

 private:
  // `blocks_rdma`: with this problem no call here can take RDMA.
  void Problem(const std::string& what, const std::string& fix,
               bool blocks_rdma = false) {
    if (blocks_rdma && blocker_.empty()) blocker_ = what;
    report_.problems.push_back(absl::StrCat(what, ". Fix: ", fix));
  }

  // Lists devices, ports and GIDs; true when some port is ACTIVE.
  bool Devices() {
    out_ << "\nRDMA devices\n";
    int count = 0;
    errno = 0;
    DeviceList list(ibv_get_device_list(&count));
    if (list == nullptr) {
      out_ << "  none: ibv_get_device_list failed: " << std::strerror(errno)
           << "\n";
      Problem("the kernel offers no RDMA (ibv_get_device_list: " +
                  std::string(std::strerror(errno)) + ")",
              kSoftRoceFix, true);
      return false;
    }
    if (count == 0) {
      out_ << "  none\n";
      Problem("this host has no RDMA device", kSoftRoceFix, true);
      return false;
    }
    bool any_active = false;
    for (int i = 0; i < count; ++i) {
      const std::string name = ibv_get_device_name(list.get()[i]);
      DeviceContext ctx(ibv_open_device(list.get()[i]));
      if (ctx == nullptr) {
        out_ << "  " << name << ": cannot open: " << std::strerror(errno)
             << "\n";
        Problem(absl::StrCat("RDMA device ", name, " cannot be opened (",
                             std::strerror(errno), ")"),
                "give this user access to /dev/infiniband/uverbs* (group "
                "rdma, or run as root)",
                true);
        continue;
      }
      ibv_device_attr attr{};
      if (ibv_query_device(ctx.get(), &attr) != 0) {
        out_ << "  " << name << ": ibv_query_device failed\n";
        continue;
      }
      out_ << "  " << name
           << (rdma::IsSoftwareDevice(ctx.get()) ? " (software)" : "")
           << ", firmware " << (attr.fw_ver[0] ? attr.fw_ver : "-") << ", "
           << static_cast<int>(attr.phys_port_cnt) << " port(s)\n";
      for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
        any_active |= Port(name, ctx.get(), p);
      }
    }
    return any_active;
  }

  bool Port(const std::string& device, ibv_context* ctx, uint8_t p) {
    ibv_port_attr port{};
    if (ibv_query_port(ctx, p, &port) != 0) {
      out_ << "    port " << int{p} << ": ibv_query_port failed\n";
      return false;
    }
    const std::string dir = absl::StrCat("/sys/class/infiniband/", device,
                                         "/ports/", int{p}, "/gid_attrs/");
    out_ << "    port " << int{p} << ": " << PortState(port.state)
         << ", link layer "
         << (port.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet"
                                                        : "InfiniBand")
         << ", MTU " << MtuBytes(port.active_mtu) << " (max "
         << MtuBytes(port.max_mtu) << ")\n";
    for (int g = 0; g < port.gid_tbl_len; ++g) {
      ibv_gid gid{};
      if (ibv_query_gid(ctx, p, g, &gid) != 0) break;
      static const ibv_gid kZero{};
      if (std::memcmp(&gid, &kZero, sizeof(gid)) == 0) continue;
      char text[INET6_ADDRSTRLEN];
      inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
      std::string type = ReadSysfs(absl::StrCat(dir, "types/", g));
      std::string netdev = ReadSysfs(absl::StrCat(dir, "ndevs/", g));
      out_ << "      GID " << g << ": " << text;
      if (!type.empty()) out_ << " (" << type << ")";
      if (!netdev.empty()) out_ << " on " << netdev;
      out_ << "\n";
    }
    if (port.state != IBV_PORT_ACTIVE) {
      Problem(absl::StrCat(device, " port ", int{p}, " is ",
                           PortState(port.state), ", not ACTIVE"),
              "bring its link up (`ip link set <netdev> up`; for InfiniBand, "
              "check the cable and that a subnet manager runs)",
              true);
      return false;
    }
    if (port.link_layer == IBV_LINK_LAYER_ETHERNET &&
        port.active_mtu < IBV_MTU_1024) {
      Problem(absl::StrCat(device, " port ", int{p}, " runs an RDMA MTU of ",
                           MtuBytes(port.active_mtu), " bytes"),
              "raise the netdev's MTU (`ip link set <netdev> mtu 9000`, or "
              "at least 1500): RDMA MTU follows it");
    }
    return true;
  }

  bool Address(bool active_port) {
    out_ << "\nRDMA address\n";
    StatusOr<std::string> address = rdma::FindRdmaIpv4Address();
    if (address.ok()) {
      out_ << "  " << *address
           << ": a server here takes RDMA connections on it (the RDMA "
              "handshake tells clients)\n";
      return true;
    }
    out_ << "  none: " << address.status().message() << "\n";
    if (active_port) {
      Problem("no IPv4 address of this host belongs to the ACTIVE RDMA port",
              "give the RDMA port's netdev an IPv4 address (`ip addr add "
              "10.0.0.7/24 dev <netdev>`) or set RDMARPC_RDMA_ADDR to one",
              true);
    }
    return false;
  }

  void LockedMemory() {
    out_ << "\nLocked memory\n";
    rdma::ConnectionConfig config;
    const uint64_t per_connection =
        uint64_t{config.receives} * config.receive_bytes +
        uint64_t{config.peer_receives} * config.peer_receive_bytes;
    rlimit limit{};
    getrlimit(RLIMIT_MEMLOCK, &limit);
    const std::string explain = absl::StrCat(
        "each RDMA connection registers up to ", Bytes(per_connection),
        " of control buffers (less where connections share a receive "
        "queue); tensors moved over RDMA register their memory too");
    if (HasIpcLock()) {
      out_ << "  not limited: this process has CAP_IPC_LOCK (" << explain
           << ")\n";
      return;
    }
    if (limit.rlim_cur == RLIM_INFINITY) {
      out_ << "  unlimited (" << explain << ")\n";
      return;
    }
    const uint64_t connections = limit.rlim_cur / per_connection;
    out_ << "  limit " << Bytes(limit.rlim_cur) << ": room for " << connections
         << " RDMA connection(s) and no more (" << explain << ")\n";
    if (limit.rlim_cur < (uint64_t{1} << 30)) {
      Problem(absl::StrCat("the locked-memory limit is ", Bytes(limit.rlim_cur),
                           ": ", connections,
                           " RDMA connection(s), and tensors larger than "
                           "what is left fail to register"),
              "raise `ulimit -l` (`ulimit -l unlimited`; memlock in "
              "/etc/security/limits.conf; LimitMEMLOCK=infinity for a "
              "systemd unit; `--ulimit memlock=-1` for docker)");
    }
  }

  void Gpus() {
    out_ << "\nGPUs\n";
    const int gpus = CudaDeviceCount();
    if (gpus == 0) {
      Status why = CudaDeviceStatus(0);
      out_ << "  none: "
           << (why.ok() ? std::string("no CUDA device")
                        : std::string(why.message()))
           << "\n  (tensors on the GPU need one; host tensors are "
              "unaffected)\n";
      return;
    }
    Status peer_memory = rdma::ProbePeerMemory();
    out_ << "  " << gpus << " GPU(s); nvidia-peermem: "
         << (peer_memory.ok() ? "loaded" : std::string(peer_memory.message()))
         << "\n";
    int count = 0;
    DeviceList list(ibv_get_device_list(&count));
    for (int i = 0; list != nullptr && i < count; ++i) {
      const std::string name = ibv_get_device_name(list.get()[i]);
      DeviceContext ctx(ibv_open_device(list.get()[i]));
      if (ctx == nullptr) continue;
      StatusOr<rdma::ProtectionDomain> pd = rdma::AllocatePd(ctx.get());
      if (!pd.ok()) continue;
      Status dma_buf = rdma::ProbeNicDmaBuf(pd->get());
      out_ << "  " << name << " takes dma-bufs: "
           << (dma_buf.ok() ? "yes" : std::string(dma_buf.message())) << "\n";
      for (int gpu = 0; gpu < gpus; ++gpu) {
        StatusOr<rdma::GpuRdmaChoice> choice =
            rdma::ChooseGpuRdmaMode(gpu, pd->get(), GpuRdmaMode::kAuto);
        out_ << "  GPU " << gpu << " with " << name << ": ";
        if (!choice.ok()) {
          out_ << "no mode: " << choice.status().message() << "\n";
          continue;
        }
        out_ << GpuRdmaModeName(choice->mode) << " (" << choice->reason
             << ")\n";
        if (choice->mode == GpuRdmaMode::kStaging) {
          Problem(absl::StrCat("GPU ", gpu, " and ", name,
                               " move tensors through host staging buffers "
                               "(a copy each way)"),
                  "load nvidia-peermem (`modprobe nvidia-peermem`) or use a "
                  "kernel and NIC driver with dma-buf support (Linux 5.12+, "
                  "rdma-core 34+)");
        }
      }
    }
  }

  bool Peer(bool active_port) {
    out_ << "\nPeer " << options_.peer << "\n";
    if (!active_port) {
      out_ << "  route not checked: this host has no ACTIVE RDMA port\n";
      return false;
    }
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* found = nullptr;
    if (int rc = getaddrinfo(options_.peer.c_str(), nullptr, &hints, &found)) {
      out_ << "  does not resolve: " << gai_strerror(rc) << "\n";
      Problem(absl::StrCat("peer ", options_.peer, " does not resolve (",
                           gai_strerror(rc), ")"),
              "give its IPv4 address or a name DNS knows", true);
      return false;
    }
    sockaddr_in dst = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
    freeaddrinfo(found);
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &dst.sin_addr, text, sizeof(text));
    Status routed = Route(&dst);
    if (routed.ok()) return true;
    out_ << "  rdma_cm cannot reach " << text << ": " << routed.message()
         << "\n";
    Problem(absl::StrCat("rdma_cm has no route to ", options_.peer, " (", text,
                         "): ", routed.message()),
            "the peer must be reachable through an RDMA port's netdev (same "
            "subnet, or a route via it); check `ip route get <peer>`",
            true);
    return false;
  }

  Status Route(sockaddr_in* dst) {
    RDMARPC_ASSIGN_OR_RETURN(rdma::EventChannel events,
                             rdma::CreateEventChannel());
    RDMARPC_ASSIGN_OR_RETURN(rdma::CmId id, rdma::CreateCmId(events.get()));
    constexpr int kTimeoutMs = 2000;
    if (rdma_resolve_addr(id.get(), nullptr, reinterpret_cast<sockaddr*>(dst),
                          kTimeoutMs) != 0) {
      return absl::UnavailableError(
          absl::StrCat("rdma_resolve_addr: ", std::strerror(errno)));
    }
    RDMARPC_RETURN_IF_ERROR(
        rdma::WaitCmEvent(events.get(), RDMA_CM_EVENT_ADDR_RESOLVED,
                          std::chrono::milliseconds(2 * kTimeoutMs))
            .status());
    if (rdma_resolve_route(id.get(), kTimeoutMs) != 0) {
      return absl::UnavailableError(
          absl::StrCat("rdma_resolve_route: ", std::strerror(errno)));
    }
    RDMARPC_RETURN_IF_ERROR(
        rdma::WaitCmEvent(events.get(), RDMA_CM_EVENT_ROUTE_RESOLVED,
                          std::chrono::milliseconds(2 * kTimeoutMs))
            .status());
    out_ << "  rdma_cm routes to it through "
         << (id->verbs ? ibv_get_device_name(id->verbs->device) : "?")
         << " port " << int{id->port_num} << "\n";
    return absl::OkStatus();
  }

  const DoctorOptions& options_;
  std::ostringstream out_;
  DoctorReport report_;
  std::string blocker_;  // the first problem that rules RDMA out
};

}  // namespace

DoctorReport RunDoctor(const DoctorOptions& options) {
  return Doctor(options).Run();
}

}  // namespace rdmarpc::tools
