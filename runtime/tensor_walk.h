// Finds the rdmarpc.Tensor fields of a message, in "walk order": a
// depth-first walk over the set fields in field-number order (repeated
// fields element by element). Both peers walk the same bytes the same way,
// so the k-th tensor on one side is the k-th on the other; that index is
// how out-of-band bytes find their field.
#ifndef RDMARPC_RUNTIME_TENSOR_WALK_H_
#define RDMARPC_RUNTIME_TENSOR_WALK_H_

#include <vector>

#include "google/protobuf/message.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.pb.h"

namespace rdmarpc::internal {

// INVALID_ARGUMENT if a map field holds tensors (map order is not stable
// across peers) or the nesting is deeper than protobuf's parse limit.
Status CollectTensors(const google::protobuf::Message& msg,
                      std::vector<const Tensor*>* out);
Status CollectMutableTensors(google::protobuf::Message* msg,
                             std::vector<Tensor*>* out);
// The number of the top-level field of `msg` that holds each tensor, in
// walk order.
Status CollectTensorTopFields(const google::protobuf::Message& msg,
                              std::vector<int>* out);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_TENSOR_WALK_H_
