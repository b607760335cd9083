// The RDMA server's listening endpoint: binds an rdma_cm id to an address,
// runs the CM event loop on its own thread ("rdmarpc-cm") and listens again
// when the device comes back after a removal (rxe re-added, driver reset).
// It decides nothing about clients: connect requests and the events of
// accepted connections go to the callbacks it was started with, on its
// thread. It sleeps until a CM event or Stop(); only while its device is
// gone does it wake (every 200 ms) to try listening again.
//
//   CmListener::Events events;
//   events.connect_request = [&](const CmEvent& e) { accept or reject e.id };
//   auto listener = CmListener::Start("", std::move(events));
//   if (!listener.ok()) this host has no RDMA: listener.status() says why
//   (*listener)->port();  // the CM port clients connect to
#ifndef RDMARPC_TRANSPORT_RDMA_LISTENER_H_
#define RDMARPC_TRANSPORT_RDMA_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "rdmarpc/status.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class CmListener {
 public:
  struct Events {
    // A client asks to connect. The callee owns `event.id`: it accepts the
    // id, or rejects and destroys it.
    std::function<void(const CmEvent&)> connect_request;
    // Accepted connection `id` is gone (disconnected, connect error,
    // unreachable, or its device removed).
    std::function<void(rdma_cm_id* id, rdma_cm_event_type type)> lost;
    // The listener's device was removed: nothing listens until it is back.
    std::function<void()> dropped;
  };

  // Listens on `address` (IPv4; empty: the first address with an ACTIVE
  // RDMA port; the port is chosen by the CM). FAILED_PRECONDITION when this
  // host has no usable RDMA device.
  static StatusOr<std::unique_ptr<CmListener>> Start(std::string address,
                                                     Events events);
  // Stop()s.
  ~CmListener();

  // Ends the event loop; no callback runs once it returns.
  void Stop();

  const std::string& address() const { return address_; }
  // The channel of the listener's ids and of the connections it accepts;
  // each connection holds it until its id is destroyed.
  const SharedEventChannel& channel() const { return channel_; }
  uint16_t port() const;
  // Empty while listening; else why not.
  std::string not_listening() const;
  // "listening on <address>:<port> (<device>)", or why not.
  std::string status() const;

 private:
  CmListener(std::string address, Events events)
      : address_(std::move(address)), events_(std::move(events)) {}
  void Loop();
  // Binds and listens on address_. Requires mu_.
  Status ListenLocked();

  const std::string address_;
  const Events events_;
  SharedEventChannel channel_;
  // Stop() writes here: the loop sleeps on the CM channel and this, with no
  // timeout while listening, so an idle server's listener never wakes.
  UniqueFd wake_fd_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  mutable std::mutex mu_;
  CmId listen_id_;
  uint16_t port_ = 0;
  std::string device_;
  std::string not_listening_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_LISTENER_H_
