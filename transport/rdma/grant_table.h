// The grants one side of a connection has open: the id each grant carries
// and the call it lands for. The peer's last write of a grant carries the
// grant id as its immediate; the id finds the call again.
//
//   GrantTable grants;
//   uint32_t id = grants.Issue(call_id);          // send Grant{id, regions}
//   StatusOr<uint64_t> call = grants.Redeem(imm);  // the write landed
//
// Not thread-safe: the endpoint that owns it locks around it.
#ifndef RDMARPC_TRANSPORT_RDMA_GRANT_TABLE_H_
#define RDMARPC_TRANSPORT_RDMA_GRANT_TABLE_H_

#include <cstdint>
#include <map>

#include "rdmarpc/status.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/rdma_frame.pb.h"

namespace rdmarpc::rdma {

class GrantTable {
 public:
  // A new grant for `call_id`: its frame, with the regions of `in.landing`.
  // Ids are never 0 (an immediate of 0 names no grant).
  Grant Issue(uint64_t call_id, const IncomingPayload& in);
  // The call whose grant `immediate` names; the grant ends. INVALID_ARGUMENT
  // for an id this side did not issue or already redeemed (the peer broke
  // the protocol).
  [[nodiscard]] StatusOr<uint64_t> Redeem(uint32_t immediate);
  // Ends grant `id` unredeemed (its call finished another way); 0: none.
  void Forget(uint32_t id);
  void Clear();

 private:
  std::map<uint32_t, uint64_t> calls_;  // grant id -> call id
  uint32_t next_id_ = 1;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_GRANT_TABLE_H_
