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

template <typename MessageT, typename TensorT>
Status Walk(MessageT& msg, std::vector<TensorT*>* out, int depth) {
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
    if (f->is_repeated()) {
      int n = r->FieldSize(msg, f);
      for (int i = 0; i < n; ++i) {
        if constexpr (std::is_const_v<MessageT>) {
          const Message& sub = r->GetRepeatedMessage(msg, f, i);
          if (tensor) {
            out->push_back(static_cast<TensorT*>(&sub));
          } else {
            RDMARPC_RETURN_IF_ERROR(Walk(sub, out, depth + 1));
          }
        } else {
          Message* sub = r->MutableRepeatedMessage(&msg, f, i);
          if (tensor) {
            out->push_back(static_cast<TensorT*>(sub));
          } else {
            RDMARPC_RETURN_IF_ERROR(Walk(*sub, out, depth + 1));
          }
        }
      }
    } else {
      if constexpr (std::is_const_v<MessageT>) {
        const Message& sub = r->GetMessage(msg, f);
        if (tensor) {
          out->push_back(static_cast<TensorT*>(&sub));
        } else {
          RDMARPC_RETURN_IF_ERROR(Walk(sub, out, depth + 1));
        }
      } else {
        Message* sub = r->MutableMessage(&msg, f);
        if (tensor) {
          out->push_back(static_cast<TensorT*>(sub));
        } else {
          RDMARPC_RETURN_IF_ERROR(Walk(*sub, out, depth + 1));
        }
      }
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
  return Walk<const Message, const Tensor>(msg, out, 0);
}

Status CollectMutableTensors(Message* msg, std::vector<Tensor*>* out) {
  out->clear();
  if (IsTensor(msg->GetDescriptor())) {
    return absl::InvalidArgumentError(
        "a call's message cannot itself be an rdmarpc.Tensor; wrap it");
  }
  return Walk<Message, Tensor>(*msg, out, 0);
}

}  // namespace rdmarpc::internal
