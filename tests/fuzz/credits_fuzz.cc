// Fuzz target for what a peer's receive completions carry: the credit
// counts it returns (transport/rdma/flow_control.h) and the immediates of
// its writes, which name a grant (grant_table.h). Each input byte is one
// event on a connection's window or grant table, with the peer's counts and
// immediates taken from the input. Both sides start with 4 of 8 receives
// and grant more. Whatever the peer claims, the window must refuse what it
// does not owe or may not grant, and frames past the peer's allotment (an
// error, not a crash), never count more credits or slots than exist, and
// an immediate finds its call only while its grant is open.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "fuzz_seeds.h"
#include "transport/rdma/flow_control.h"
#include "transport/rdma/grant_table.h"

namespace {

using rdmarpc::rdma::CreditWindow;

constexpr CreditWindow::Options kOptions{.peer_receives = 8,
                                         .peer_first_receives = 4,
                                         .send_queue_slots = 16,
                                         .own_receives = 8,
                                         .own_first_receives = 4};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  CreditWindow window(kOptions);
  rdmarpc::rdma::GrantTable grants;
  std::map<uint32_t, uint64_t> open_grants;  // what the table must hold
  uint64_t next_call = 1;
  uint32_t taken_slots = 0;    // posted, not yet completed
  uint32_t owed_receives = 0;  // peer frames received, receive not re-posted
  for (size_t i = 0; i < size; ++i) {
    uint8_t op = data[i] & 7;
    uint8_t arg = data[i] >> 3;  // 0..31
    switch (op) {
      case 0:
        if (window.TryTakeForData()) ++taken_slots;
        break;
      case 1:
        if (window.TryTakeForCreditReturn()) ++taken_slots;
        break;
      case 2:
        if (window.TryTakeSendSlot()) ++taken_slots;
        break;
      case 3: {
        uint32_t n = arg % 4;
        bool ok = window.OnSendCompleted(n).ok();
        if (ok != (n <= taken_slots)) std::abort();
        if (ok) taken_slots -= n;
        break;
      }
      case 4:  // a frame from the peer, its preamble returning `arg`
        // It can only land in a receive we posted (all 8 are).
        if (owed_receives + window.returnable() >= kOptions.own_receives) break;
        if (!window.OnPeerReturned(arg).ok()) return 0;  // connection fails
        ++owed_receives;
        break;
      case 5:
        if (owed_receives > 0) {
          // Refused exactly when the peer sent past its allotment.
          const bool overrun = window.returnable() >= window.own_allotment();
          if (window.OnReceiveReposted().ok() == overrun) std::abort();
          if (overrun) return 0;  // connection fails
          --owed_receives;
        }
        break;
      case 6:
        if (arg & 1) {
          const uint32_t wanted = window.GrantWanted();
          if (wanted > kOptions.own_receives - window.own_allotment()) {
            std::abort();
          }
          window.Grant(std::min<uint32_t>(arg >> 1, wanted));
        } else {
          (void)window.TakeReturnable();
        }
        break;
      default: {
        const uint32_t immediate = arg >> 2;  // 0..7: ids issued first
        switch (arg & 3) {
          case 0:
            (void)window.ShouldSendCreditReturn();
            break;
          case 1: {
            uint64_t call = next_call++;
            uint32_t id = grants.Issue(call, {}).grant_id();
            if (id == 0 || open_grants.contains(id)) std::abort();
            open_grants[id] = call;
            break;
          }
          case 2: {  // a write landed with `immediate`
            auto call = grants.Redeem(immediate);
            auto it = open_grants.find(immediate);
            if (call.ok() != (it != open_grants.end())) std::abort();
            if (call.ok()) {
              if (*call != it->second) std::abort();
              open_grants.erase(it);
            }
            break;
          }
          default:
            grants.Forget(immediate);
            open_grants.erase(immediate);
        }
      }
    }
    if (window.peer_credits() > window.peer_allotment() ||
        window.peer_allotment() > kOptions.peer_receives ||
        window.free_send_slots() > kOptions.send_queue_slots ||
        window.returnable() > window.own_allotment() ||
        window.own_allotment() > kOptions.own_receives) {
      std::abort();
    }
  }
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  // Take, complete, receive a frame returning 1, re-post, return credits.
  // Issue two grants, redeem immediate 1 twice, forget 2, redeem 2.
  return {std::string("\x00\x08\x0c\x05\x06", 5),
          std::string("\x00\x00\x00\x00\x00\x00\x00\x01\x1c\x0b", 10),
          std::string("\x0f\x0f\x37\x37\x5f\x57", 6)};
}
