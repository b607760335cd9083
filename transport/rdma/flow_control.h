// Credit-based flow control for one RDMA connection.
//
// A SEND (or a WRITE WITH IMMEDIATE) consumes one receive the peer posted;
// any work request needs a free slot in our send queue. CreditWindow counts
// both, so a work request is posted only when both are there: no send ever
// fails for lack of either, and the peer never answers receiver-not-ready.
// What cannot go yet waits in the connection's queue until
// OnPeerReturned/OnSendCompleted make room.
//
// Credits come back piggybacked: every frame's preamble carries the number of
// receives its sender re-posted since its previous frame, plus any credits it
// grants (below). When a side has
// nothing else to send it returns them in a credit frame once
// `return_threshold` have piled up. The last peer receive is kept for such a
// frame (data frames leave it alone), so two sides that both ran out can
// always tell each other; credit frames themselves are returned lazily, so
// they never ping-pong.
//
// Grants: a side starts with `first` credits of the peer's (its allotment)
// and may be granted more, up to the peer's `receives`, which the peer backs
// with receives from its pool (a shared receive queue's, or its own). A
// sender running low sets WantsCredits() in its frames' preambles; the
// receiver grants by returning more than it owes (Grant), and the sender
// takes the excess over what it was owed as a grant (OnPeerReturned). A
// receiver never takes credits back, so what a sender was owed stays exact.
//
//   CreditWindow window({.peer_receives = 64, .send_queue_slots = 128});
//   if (window.TryTakeForData()) {
//     preamble.credits = window.TakeReturnable();
//     post the SEND;
//   }
//   ... on the send's completion: window.OnSendCompleted();
//   ... on a received frame:      window.OnPeerReturned(preamble.credits);
//                                 re-post the receive;
//                                 window.OnReceiveReposted();
//   if (window.ShouldSendCreditReturn() && window.TryTakeForCreditReturn()) ...
//
// Not thread-safe: one connection's progress thread owns it.
#ifndef RDMARPC_TRANSPORT_RDMA_FLOW_CONTROL_H_
#define RDMARPC_TRANSPORT_RDMA_FLOW_CONTROL_H_

#include <cstdint>

#include "rdmarpc/status.h"

namespace rdmarpc::rdma {

class CreditWindow {
 public:
  struct Options {
    // The most receives the peer may back for us (from the handshake): the
    // ceiling of our allotment.
    uint32_t peer_receives = 64;
    // Our allotment at connection time (from the handshake); 0: all of
    // peer_receives.
    uint32_t peer_first_receives = 0;
    // Our send queue depth (max_send_wr of the queue pair).
    uint32_t send_queue_slots = 128;
    // The most receives we back for the peer: the ceiling of its
    // allotment, and so the most credits we can owe it.
    uint32_t own_receives = 64;
    // The peer's allotment at connection time; 0: all of own_receives.
    uint32_t own_first_receives = 0;
    // Pending returns that justify a frame of their own; 0: half of the
    // peer's allotment as it stands. At least 2 (one credit frame then
    // cannot answer another) and below own_receives (so a side that holds
    // all but the reserved credit always gets them back): receives must
    // be >= 4. Above half the allotment, half the allotment.
    uint32_t return_threshold = 0;
  };

  // Call Validate(options) first; the constructor assumes valid options.
  explicit CreditWindow(const Options& options);
  // INVALID_ARGUMENT naming the setting when the window could stall.
  [[nodiscard]] static Status Validate(const Options& options);

  // A frame that is not a pure credit return, or a WRITE WITH IMMEDIATE:
  // takes one peer receive (keeping the last one back) and one send slot.
  [[nodiscard]] bool TryTakeForData();
  // A credit frame: may take the last peer receive. False when there is
  // nothing to return.
  [[nodiscard]] bool TryTakeForCreditReturn();
  // A WRITE without immediate consumes no receive: one send slot.
  [[nodiscard]] bool TryTakeSendSlot();
  // Whether TryTakeForData / TryTakeForCreditReturn would succeed now.
  bool CanTakeForData() const { return peer_credits_ >= 2 && free_slots_ > 0; }
  bool CanTakeForCreditReturn() const {
    return returnable_ > 0 && peer_credits_ > 0 && free_slots_ > 0;
  }

  // The count to put in the next frame's preamble; resets it.
  uint32_t TakeReturnable();
  // Whether pending returns justify a credit frame now.
  bool ShouldSendCreditReturn() const;

  // Whether our frames should ask the peer for more credits: a quarter or
  // less of our allotment is left, and the peer may grant more.
  bool WantsCredits() const;
  // Receiver: how many credits a peer that asks should be granted now
  // (doubling its allotment, up to own_receives); 0 when it has them all.
  uint32_t GrantWanted() const;
  // Receiver: grants the peer `n` more credits, backed by receives the
  // caller made sure of; they go out with the next returns. At most
  // GrantWanted().
  void Grant(uint32_t n);

  // `n` of our work requests completed (their send slots are free again).
  // INTERNAL if more complete than were taken: a bookkeeping bug.
  [[nodiscard]] Status OnSendCompleted(uint32_t n = 1);
  // The peer returned `n` receives; beyond what it owed, a grant.
  // FAILED_PRECONDITION (a protocol violation: fail the connection) if the
  // grant takes our allotment past peer_receives.
  [[nodiscard]] Status OnPeerReturned(uint32_t n);
  // We re-posted one receive the peer had consumed. FAILED_PRECONDITION
  // (a protocol violation) if that makes more than the peer's allotment:
  // it sent a frame without a credit.
  [[nodiscard]] Status OnReceiveReposted();

  uint32_t peer_credits() const { return peer_credits_; }
  uint32_t free_send_slots() const { return free_slots_; }
  uint32_t returnable() const { return returnable_; }
  // Credits the peer granted us so far / allotment: ours of the peer's
  // receives, and the peer's of ours.
  uint32_t peer_allotment() const { return peer_allotted_; }
  uint32_t own_allotment() const { return own_allotted_; }

 private:
  Options options_;
  uint32_t peer_credits_;
  uint32_t peer_allotted_;
  uint32_t own_allotted_;
  uint32_t free_slots_;
  uint32_t returnable_ = 0;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_FLOW_CONTROL_H_
