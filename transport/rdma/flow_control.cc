#include "transport/rdma/flow_control.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

namespace {

uint32_t FirstOr(uint32_t first, uint32_t all) {
  return first == 0 ? all : first;
}

}  // namespace

CreditWindow::CreditWindow(const Options& options)
    : options_(options),
      peer_credits_(
          FirstOr(options.peer_first_receives, options.peer_receives)),
      peer_allotted_(peer_credits_),
      own_allotted_(FirstOr(options.own_first_receives, options.own_receives)),
      free_slots_(options.send_queue_slots) {}

Status CreditWindow::Validate(const Options& options) {
  if (options.peer_receives < 4 || options.own_receives < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA control receives must be at least 4 per side (peer ",
        options.peer_receives, ", own ", options.own_receives, ")"));
  }
  const uint32_t peer_first =
      FirstOr(options.peer_first_receives, options.peer_receives);
  const uint32_t own_first =
      FirstOr(options.own_first_receives, options.own_receives);
  if (peer_first < 4 || peer_first > options.peer_receives || own_first < 4 ||
      own_first > options.own_receives) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA first control receives must be in [4, receives] (peer ",
        peer_first, " of ", options.peer_receives, ", own ", own_first, " of ",
        options.own_receives, ")"));
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
  if (!CanTakeForData()) return false;
  --peer_credits_;
  --free_slots_;
  return true;
}

bool CreditWindow::TryTakeForCreditReturn() {
  if (!CanTakeForCreditReturn()) return false;
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
  const uint32_t half = std::max<uint32_t>(2, own_allotted_ / 2);
  const uint32_t threshold = options_.return_threshold == 0
                                 ? half
                                 : std::min(options_.return_threshold, half);
  return returnable_ >= threshold;
}

bool CreditWindow::WantsCredits() const {
  return peer_allotted_ < options_.peer_receives &&
         peer_credits_ <= peer_allotted_ / 4;
}

uint32_t CreditWindow::GrantWanted() const {
  return std::min(own_allotted_, options_.own_receives - own_allotted_);
}

void CreditWindow::Grant(uint32_t n) {
  own_allotted_ += n;
  returnable_ += n;
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
  const uint32_t owed = peer_allotted_ - peer_credits_;
  if (n > owed) {
    const uint32_t granted = n - owed;
    if (granted > options_.peer_receives - peer_allotted_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "peer returned ", n, " receive credits but owed only ", owed,
          " and may grant only ", options_.peer_receives - peer_allotted_,
          " more (protocol violation; closing the connection)"));
    }
    peer_allotted_ += granted;
  }
  peer_credits_ += n;
  return absl::OkStatus();
}

Status CreditWindow::OnReceiveReposted() {
  if (returnable_ >= own_allotted_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the peer sent more frames than its ", own_allotted_,
                     " credits (protocol violation; closing the connection)"));
  }
  ++returnable_;
  return absl::OkStatus();
}

}  // namespace rdmarpc::rdma
