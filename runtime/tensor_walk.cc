#include "runtime/tensor_walk.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace rdmarpc::internal {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr int kMaxDepth = 100;  // protobuf's default recursion limit

bool IsTensor(const google::protobuf::Descriptor* d) {
  return d == Tensor::descriptor();
}

// Whether messages of type `d` can contain a Tensor somewhere below
// (exact: each type is visited once, so recursive types terminate).
bool MayHoldTensor(
    const google::protobuf::Descriptor* d,
    absl::flat_hash_set<const google::protobuf::Descriptor*>* seen) {
  if (IsTensor(d)) return true;
  if (!seen->insert(d).second) return false;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
        MayHoldTensor(f->message_type(), seen)) {
      return true;
    }
  }
  return false;
}

// `top`, when given, receives the top-level field number of each tensor.
Status Walk(const Message& msg, std::vector<const Tensor*>* out, int depth,
            std::vector<int>* top, int top_field) {
  if (depth > kMaxDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("message nesting deeper than ", kMaxDepth));
  }
  const Reflection* r = msg.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(msg, &fields);  // set fields, in field-number order
  for (const FieldDescriptor* f : fields) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_map()) {
      absl::flat_hash_set<const google::protobuf::Descriptor*> seen;
      if (MayHoldTensor(f->message_type(), &seen)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "field ", f->full_name(),
            " is a map holding rdmarpc.Tensor values; tensors in maps are "
            "not supported (use a repeated message with a key field)"));
      }
      continue;
    }
    const bool tensor = IsTensor(f->message_type());
    const int field = depth == 0 ? f->number() : top_field;
    auto visit = [&](const Message& sub) -> Status {
      if (!tensor) return Walk(sub, out, depth + 1, top, field);
      out->push_back(static_cast<const Tensor*>(&sub));
      if (top != nullptr) top->push_back(field);
      return absl::OkStatus();
    };
    if (f->is_repeated()) {
      for (int i = 0, n = r->FieldSize(msg, f); i < n; ++i) {
        RDMARPC_RETURN_IF_ERROR(visit(r->GetRepeatedMessage(msg, f, i)));
      }
    } else {
      RDMARPC_RETURN_IF_ERROR(visit(r->GetMessage(msg, f)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status CollectTensors(const Message& msg, std::vector<const Tensor*>* out) {
  out->clear();
  if (IsTensor(msg.GetDescriptor())) {
    return absl::InvalidArgumentError(
        "a call's message cannot itself be an rdmarpc.Tensor; wrap it");
  }
  return Walk(msg, out, 0, nullptr, 0);
}

Status CollectTensorTopFields(const Message& msg, std::vector<int>* out) {
  out->clear();
  std::vector<const Tensor*> tensors;
  if (IsTensor(msg.GetDescriptor())) return CollectTensors(msg, &tensors);
  return Walk(msg, &tensors, 0, out, 0);
}

Status CollectMutableTensors(Message* msg, std::vector<Tensor*>* out) {
  // The walk only visits set fields, whose sub-messages are the objects
  // `msg` owns, so handing them out mutable is sound.
  std::vector<const Tensor*> found;
  RDMARPC_RETURN_IF_ERROR(CollectTensors(*msg, &found));
  out->clear();
  out->reserve(found.size());
  for (const Tensor* t : found) out->push_back(const_cast<Tensor*>(t));
  return absl::OkStatus();
}

}  // namespace rdmarpc::internal
