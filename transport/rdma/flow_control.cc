#include "transport/rdma/flow_control.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

CreditWindow::CreditWindow(const Options& options)
    : options_(options),
      peer_credits_(options.peer_receives),
      free_slots_(options.send_queue_slots) {
  if (options_.return_threshold == 0) {
    options_.return_threshold =
        std::max<uint32_t>(2, options_.own_receives / 2);
  }
}

Status CreditWindow::Validate(const Options& options) {
  if (options.peer_receives < 4 || options.own_receives < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA control receives must be at least 4 per side (peer ",
        options.peer_receives, ", own ", options.own_receives, ")"));
  }
  if (options.send_queue_slots == 0) {
    return absl::InvalidArgumentError("RDMA send queue depth must be > 0");
  }
  if (options.return_threshold != 0 &&
      (options.return_threshold < 2 ||
       options.return_threshold >= options.own_receives)) {
    return absl::InvalidArgumentError(
        absl::StrCat("credit return threshold ", options.return_threshold,
                     " must be in [2, ", options.own_receives, ")"));
  }
  return absl::OkStatus();
}

bool CreditWindow::TryTakeForData() {
  if (peer_credits_ < 2 || free_slots_ == 0) return false;
  --peer_credits_;
  --free_slots_;
  return true;
}

bool CreditWindow::TryTakeForCreditReturn() {
  if (returnable_ == 0 || peer_credits_ == 0 || free_slots_ == 0) return false;
  --peer_credits_;
  --free_slots_;
  return true;
}

bool CreditWindow::TryTakeSendSlot() {
  if (free_slots_ == 0) return false;
  --free_slots_;
  return true;
}

uint32_t CreditWindow::TakeReturnable() {
  uint32_t n = returnable_;
  returnable_ = 0;
  return n;
}

bool CreditWindow::ShouldSendCreditReturn() const {
  return returnable_ >= options_.return_threshold;
}

Status CreditWindow::OnSendCompleted(uint32_t n) {
  if (n > options_.send_queue_slots - free_slots_) {
    return absl::InternalError(absl::StrCat(
        n, " send completions but only ",
        options_.send_queue_slots - free_slots_, " work requests posted"));
  }
  free_slots_ += n;
  return absl::OkStatus();
}

Status CreditWindow::OnPeerReturned(uint32_t n) {
  if (n > options_.peer_receives - peer_credits_) {
    return absl::FailedPreconditionError(
        absl::StrCat("peer returned ", n, " receive credits but owed only ",
                     options_.peer_receives - peer_credits_,
                     " (protocol violation; closing the connection)"));
  }
  peer_credits_ += n;
  return absl::OkStatus();
}

Status CreditWindow::OnReceiveReposted() {
  if (returnable_ >= options_.own_receives) {
    return absl::InternalError(absl::StrCat("re-posted more receives than the ",
                                            options_.own_receives,
                                            " the peer can have consumed"));
  }
  ++returnable_;
  return absl::OkStatus();
}

}  // namespace rdmarpc::rdma
