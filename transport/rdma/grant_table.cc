#include "transport/rdma/grant_table.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

Grant GrantTable::Issue(uint64_t call_id, const IncomingPayload& in) {
  Grant grant;
  grant.set_call_id(call_id);
  const uint32_t id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;
  grant.set_grant_id(id);
  AddGrantRegions(in, &grant);
  calls_[id] = call_id;
  return grant;
}

StatusOr<uint64_t> GrantTable::Redeem(uint32_t immediate) {
  auto it = calls_.find(immediate);
  if (it == calls_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("write landed for unknown grant ", immediate));
  }
  uint64_t call_id = it->second;
  calls_.erase(it);
  return call_id;
}

void GrantTable::Forget(uint32_t id) {
  if (id != 0) calls_.erase(id);
}

void GrantTable::Clear() { calls_.clear(); }

}  // namespace rdmarpc::rdma
