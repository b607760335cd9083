#include "transport/rdma/listener.h"

#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

StatusOr<std::unique_ptr<CmListener>> CmListener::Start(std::string address,
                                                        Events events) {
  if (address.empty()) {
    auto found = FindRdmaIpv4Address();
    if (!found.ok()) {
      return absl::FailedPreconditionError(found.status().message());
    }
    address = *std::move(found);
  }
  std::unique_ptr<CmListener> l(
      new CmListener(std::move(address), std::move(events)));
  RDMARPC_ASSIGN_OR_RETURN(l->channel_, CreateEventChannel());
  l->wake_fd_ = UniqueFd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (l->wake_fd_.get() < 0) {
    return VerbsError("creating the RDMA listener's wake-up eventfd", errno);
  }
  {
    std::lock_guard<std::mutex> lock(l->mu_);
    RDMARPC_RETURN_IF_ERROR(l->ListenLocked());
  }
  l->thread_ = std::thread([raw = l.get()] { raw->Loop(); });
  pthread_setname_np(l->thread_.native_handle(), "rdmarpc-cm");
  return l;
}

CmListener::~CmListener() { Stop(); }

void CmListener::Stop() {
  stop_.store(true);
  if (thread_.joinable()) {
    uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof(one));
    thread_.join();
  }
}

uint16_t CmListener::port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return port_;
}

std::string CmListener::not_listening() const {
  std::lock_guard<std::mutex> lock(mu_);
  return not_listening_;
}

std::string CmListener::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!not_listening_.empty()) return not_listening_;
  return absl::StrCat("listening on ", address_, ":", port_, " (", device_,
                      ")");
}

Status CmListener::ListenLocked() {
  RDMARPC_ASSIGN_OR_RETURN(CmId id, CreateCmId(channel_.get()));
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  if (inet_pton(AF_INET, address_.c_str(), &sin.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA address '", address_, "' is not IPv4"));
  }
  if (rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&sin)) != 0) {
    return VerbsError(absl::StrCat("rdma_bind_addr ", address_), errno);
  }
  if (rdma_listen(id.get(), 128) != 0) return VerbsError("rdma_listen", errno);
  port_ = ntohs(rdma_get_src_port(id.get()));
  if (id->verbs != nullptr) device_ = ibv_get_device_name(id->verbs->device);
  listen_id_ = std::move(id);
  not_listening_.clear();
  return absl::OkStatus();
}

void CmListener::Loop() {
  constexpr std::chrono::milliseconds kRelistenPeriod(200);
  auto next_listen = std::chrono::steady_clock::now();
  while (!stop_.load()) {
    bool listening = true;
    {
      // Listen again once the device is back.
      std::lock_guard<std::mutex> lock(mu_);
      auto now = std::chrono::steady_clock::now();
      if (!not_listening_.empty() && now >= next_listen) {
        ForgetRemovedRdmaDevices();
        Status listened = ListenLocked();
        if (!listened.ok()) {
          not_listening_ = absl::StrCat(
              "the server's RDMA device went away and listening again "
              "failed: ",
              listened.message());
        }
        next_listen = now + kRelistenPeriod;
      }
      listening = not_listening_.empty();
    }
    pollfd fds[2] = {{channel_.get()->fd, POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0}};
    int timeout_ms = listening ? -1 : static_cast<int>(kRelistenPeriod.count());
    if (poll(fds, 2, timeout_ms) <= 0 || (fds[0].revents & POLLIN) == 0) {
      continue;  // Stop(), the re-listen period, or EINTR
    }
    auto event = NextCmEvent(channel_.get(), std::chrono::milliseconds(0));
    if (!event.ok()) continue;
    bool listener = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      listener = listen_id_ && event->id == listen_id_.get();
    }
    switch (event->type) {
      case RDMA_CM_EVENT_CONNECT_REQUEST:
        events_.connect_request(*event);
        break;
      case RDMA_CM_EVENT_ESTABLISHED:
        // Nothing to do: the server counts a connection when it accepts it,
        // and may have served calls on it before this event comes.
        break;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        if (listener) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            listen_id_.reset();
            not_listening_ =
                "the server's RDMA device was removed; it listens again "
                "when the device returns";
          }
          events_.dropped();
          break;
        }
        [[fallthrough]];
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_CONNECT_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE:
        events_.lost(event->id, event->type);
        break;
      default:
        break;
    }
  }
}

}  // namespace rdmarpc::rdma
