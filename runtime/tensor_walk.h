// Finds the rdmarpc.Tensor fields of a message, in "walk order": a
// depth-first walk over the set fields in field-number order (repeated
// fields element by element). Both peers walk the same bytes the same way,
// so the k-th tensor on one side is the k-th on the other; that index is
// how out-of-band bytes find their field.
#ifndef RDMARPC_RUNTIME_TENSOR_WALK_H_
#define RDMARPC_RUNTIME_TENSOR_WALK_H_

#include <string>

#include "absl/container/inlined_vector.h"
#include "google/protobuf/message.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.pb.h"

namespace rdmarpc::internal {

// Most messages hold a few tensors: their lists stay off the heap until
// then (a walk runs several times per call).
using TensorList = absl::InlinedVector<const Tensor*, 4>;
using MutableTensorList = absl::InlinedVector<Tensor*, 4>;
using TopFieldList = absl::InlinedVector<int, 4>;

// INVALID_ARGUMENT if a map field holds tensors (map order is not stable
// across peers) or the nesting is deeper than protobuf's parse limit.
Status CollectTensors(const google::protobuf::Message& msg, TensorList* out);
// `top`, when given, receives what CollectTensorTopFields would (one walk
// for both).
Status CollectMutableTensors(google::protobuf::Message* msg,
                             MutableTensorList* out,
                             TopFieldList* top = nullptr);
// The number of the top-level field of `msg` that holds each tensor, in
// walk order.
Status CollectTensorTopFields(const google::protobuf::Message& msg,
                              TopFieldList* out);

// Message classes whose file was compiled with protoc-gen-rdmarpc are
// walked by the walker generated for them (rdmarpc/generated_support.h),
// others through protobuf reflection; both give the same result. For
// tests, the two apart:
//
// The walk of CollectMutableTensors, by reflection alone at every level.
Status CollectTensorsByReflection(const google::protobuf::Message& msg,
                                  TensorList* out, TopFieldList* top);
// Whether walks of `msg`'s class run a generated walker.
bool WalksWithGeneratedWalker(const google::protobuf::Message& msg);

// The path of `tensor` inside `msg` ("input", "layers[2].weight") for error
// messages, or "" when it is not there. A reflection search: not for the
// datapath.
std::string TensorFieldPath(const google::protobuf::Message& msg,
                            const Tensor& tensor);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_TENSOR_WALK_H_
