#include "runtime/tensor_walk.h"

#include <algorithm>
#include <atomic>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
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

// What the walk needs of a message type, computed once per type: its
// message fields that can hold a tensor below them, in field-number order.
// Fields that cannot are skipped without a look, and a type without such
// fields costs one lookup per call instead of a reflection scan.
struct Layout {
  // Types with extension ranges are walked over whatever is set
  // (ListFields), since an extension may hold a tensor.
  bool list_set_fields = false;
  std::vector<const FieldDescriptor*> fields;  // maps among them: an error
};

Layout ComputeLayout(const google::protobuf::Descriptor* d) {
  Layout layout;
  layout.list_set_fields = d->extension_range_count() > 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    absl::flat_hash_set<const google::protobuf::Descriptor*> seen;
    if (MayHoldTensor(f->message_type(), &seen)) layout.fields.push_back(f);
  }
  std::sort(layout.fields.begin(), layout.fields.end(),
            [](const FieldDescriptor* a, const FieldDescriptor* b) {
              return a->number() < b->number();
            });
  return layout;
}

// Layouts of generated message types, without a lock: an open-addressed
// table of atomic slots, filled once per type and never emptied (generated
// descriptors live as long as the process). Two threads may both compute a
// type's layout; the loser's copy is dropped. Null for other types (a
// dynamic pool's descriptor may be freed and its address reused) and once
// the table is full: the caller computes the layout for this walk.
const Layout* CachedLayoutOf(const google::protobuf::Descriptor* d) {
  if (d->file()->pool() != google::protobuf::DescriptorPool::generated_pool()) {
    return nullptr;
  }
  constexpr size_t kSlots = 4096;
  struct Slot {
    std::atomic<const google::protobuf::Descriptor*> key{nullptr};
    std::atomic<const Layout*> layout{nullptr};
  };
  static Slot* slots = new Slot[kSlots];
  size_t i = absl::HashOf(d) % kSlots;
  for (size_t probes = 0; probes < kSlots; ++probes, i = (i + 1) % kSlots) {
    Slot& slot = slots[i];
    const google::protobuf::Descriptor* key =
        slot.key.load(std::memory_order_acquire);
    if (key == nullptr &&
        slot.key.compare_exchange_strong(key, d, std::memory_order_acq_rel)) {
      key = d;
    }
    if (key != d) continue;  // another type's slot
    const Layout* layout = slot.layout.load(std::memory_order_acquire);
    if (layout != nullptr) return layout;
    auto mine = std::make_unique<Layout>(ComputeLayout(d));
    if (slot.layout.compare_exchange_strong(layout, mine.get(),
                                            std::memory_order_acq_rel)) {
      return mine.release();
    }
    return layout;
  }
  return nullptr;
}

Status MapHoldsTensors(const FieldDescriptor* f) {
  return absl::InvalidArgumentError(absl::StrCat(
      "field ", f->full_name(),
      " is a map holding rdmarpc.Tensor values; tensors in maps are "
      "not supported (use a repeated message with a key field)"));
}

// `top`, when given, receives the top-level field number of each tensor.
Status Walk(const Message& msg, TensorList* out, int depth, TopFieldList* top,
            int top_field) {
  if (depth > kMaxDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("message nesting deeper than ", kMaxDepth));
  }
  Layout computed;
  const Layout* layout = CachedLayoutOf(msg.GetDescriptor());
  if (layout == nullptr) {
    computed = ComputeLayout(msg.GetDescriptor());
    layout = &computed;
  }
  const Reflection* r = msg.GetReflection();
  std::vector<const FieldDescriptor*> set;
  const std::vector<const FieldDescriptor*>* fields = &layout->fields;
  if (layout->list_set_fields) {
    r->ListFields(msg, &set);  // set fields, in field-number order
    fields = &set;
  }
  for (const FieldDescriptor* f : *fields) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_map()) {
      absl::flat_hash_set<const google::protobuf::Descriptor*> seen;
      if (r->FieldSize(msg, f) > 0 && MayHoldTensor(f->message_type(), &seen)) {
        return MapHoldsTensors(f);
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
    } else if (r->HasField(msg, f)) {
      RDMARPC_RETURN_IF_ERROR(visit(r->GetMessage(msg, f)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status CollectTensors(const Message& msg, TensorList* out) {
  out->clear();
  if (IsTensor(msg.GetDescriptor())) {
    return absl::InvalidArgumentError(
        "a call's message cannot itself be an rdmarpc.Tensor; wrap it");
  }
  return Walk(msg, out, 0, nullptr, 0);
}

Status CollectTensorTopFields(const Message& msg, TopFieldList* out) {
  out->clear();
  TensorList tensors;
  if (IsTensor(msg.GetDescriptor())) return CollectTensors(msg, &tensors);
  return Walk(msg, &tensors, 0, out, 0);
}

Status CollectMutableTensors(Message* msg, MutableTensorList* out) {
  // The walk only visits set fields, whose sub-messages are the objects
  // `msg` owns, so handing them out mutable is sound.
  TensorList found;
  RDMARPC_RETURN_IF_ERROR(CollectTensors(*msg, &found));
  out->clear();
  out->reserve(found.size());
  for (const Tensor* t : found) out->push_back(const_cast<Tensor*>(t));
  return absl::OkStatus();
}

}  // namespace rdmarpc::internal
