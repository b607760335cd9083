#include "runtime/tensor_walk.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "rdmarpc/generated_support.h"

namespace rdmarpc::generated {

// Where a walk stands: what it collects into, and how deep it is.
struct TensorWalk {
  internal::TensorList* out = nullptr;
  internal::TopFieldList* top = nullptr;  // when given
  int depth = 0;
  int top_field = 0;  // below the top, the top-level field walked into
  // Walks every message by reflection, generated walkers or not (tests
  // compare the two).
  bool reflection_only = false;
};

}  // namespace rdmarpc::generated

namespace rdmarpc::internal {
namespace {

using generated::TensorWalk;
using generated::TensorWalker;

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr int kMaxDepth = 100;  // protobuf's default recursion limit

// Asking a message or a field descriptor for its type goes through a
// std::call_once each time (protobuf builds generated descriptors lazily),
// which costs hundreds of instructions: the walk asks once per type.
const Descriptor* TensorDescriptor() {
  static const Descriptor* const tensor = Tensor::descriptor();
  return tensor;
}

// Whether messages of type `d` can contain a Tensor somewhere below
// (exact: each type is visited once, so recursive types terminate).
bool MayHoldTensor(const Descriptor* d,
                   absl::flat_hash_set<const Descriptor*>* seen) {
  if (d == TensorDescriptor()) return true;
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

// A message field that can hold a tensor below it, with what the walk
// asks of it answered once.
struct FieldStep {
  const FieldDescriptor* field = nullptr;
  int number = 0;
  bool tensor = false;  // the field's type is rdmarpc.Tensor
  bool repeated = false;
  bool map = false;  // maps holding tensors are an error when set
};

// What the walk needs of a message type, computed once per type: its
// message fields that can hold a tensor below them, in field-number order.
// Fields that cannot are skipped without a look, and a type without such
// fields costs one lookup per call instead of a reflection scan.
struct Layout {
  const Reflection* reflection = nullptr;
  bool is_tensor = false;
  // Types with extension ranges are walked over whatever is set
  // (ListFields), since an extension may hold a tensor.
  bool list_set_fields = false;
  std::vector<FieldStep> fields;
  // The class's generated walker, when it has one: it reads the same fields
  // with the generated accessors, an order of magnitude cheaper than
  // reflection's HasField/GetMessage/FieldSize.
  TensorWalker walker = nullptr;
};

// Walkers registered by generated code, by class. Function-local, so the
// static initializers of generated files find it constructed whatever
// their order; never destroyed, as walks may run during static
// destruction. A class's walker is looked up once, when its layout enters
// the table below, so the lock is off the per-call path.
struct WalkerRegistry {
  std::mutex mu;
  absl::flat_hash_map<std::type_index, TensorWalker> walkers;
};

WalkerRegistry& Walkers() {
  static WalkerRegistry* const registry = new WalkerRegistry;
  return *registry;
}

TensorWalker RegisteredWalker(const std::type_info& type) {
  WalkerRegistry& registry = Walkers();
  std::lock_guard<std::mutex> lock(registry.mu);
  auto it = registry.walkers.find(type);
  return it == registry.walkers.end() ? nullptr : it->second;
}

FieldStep StepFor(const FieldDescriptor* f) {
  return {.field = f,
          .number = f->number(),
          .tensor = f->message_type() == TensorDescriptor(),
          .repeated = f->is_repeated(),
          .map = f->is_map()};
}

Layout ComputeLayout(const Message& msg) {
  Layout layout;
  const Descriptor* d = msg.GetDescriptor();
  layout.reflection = msg.GetReflection();
  layout.is_tensor = d == TensorDescriptor();
  layout.list_set_fields = d->extension_range_count() > 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    absl::flat_hash_set<const Descriptor*> seen;
    if (MayHoldTensor(f->message_type(), &seen)) {
      layout.fields.push_back(StepFor(f));
    }
  }
  std::sort(layout.fields.begin(), layout.fields.end(),
            [](const FieldStep& a, const FieldStep& b) {
              return a.number < b.number;
            });
  return layout;
}

// Layouts of generated message classes, without a lock: an open-addressed
// table of atomic slots keyed by the C++ class (its type_info, read from
// the object without asking protobuf anything), filled once per class and
// never emptied. Two threads may both compute a class's layout; the
// loser's copy is dropped. Only generated classes go in: each has one
// descriptor for the life of the process, where one DynamicMessage class
// serves many descriptors (which may be freed). Null for other classes and
// once the table is full: the caller computes the layout for this walk.
const Layout* CachedLayoutOf(const Message& msg) {
  constexpr size_t kSlots = 4096;
  struct Slot {
    std::atomic<const std::type_info*> key{nullptr};
    std::atomic<const Layout*> layout{nullptr};
  };
  static Slot* const slots = new Slot[kSlots];
  const std::type_info* type = &typeid(msg);
  size_t i = absl::HashOf(type) % kSlots;
  for (size_t probes = 0; probes < kSlots; ++probes, i = (i + 1) % kSlots) {
    Slot& slot = slots[i];
    const std::type_info* key = slot.key.load(std::memory_order_acquire);
    if (key == type) {
      const Layout* layout = slot.layout.load(std::memory_order_acquire);
      if (layout != nullptr) return layout;
      break;  // being filled by another thread: compute this one
    }
    if (key != nullptr) continue;  // another class's slot
    if (msg.GetReflection()->GetMessageFactory() !=
        google::protobuf::MessageFactory::generated_factory()) {
      return nullptr;  // not a generated class
    }
    if (!slot.key.compare_exchange_strong(key, type,
                                          std::memory_order_acq_rel)) {
      if (key != type) continue;  // another class took the slot
      break;
    }
    auto mine = std::make_unique<Layout>(ComputeLayout(msg));
    // A walker registered later (a library loaded after this class's first
    // walk) goes unused: the reflection walk gives the same result.
    if (!mine->list_set_fields) mine->walker = RegisteredWalker(*type);
    slot.layout.store(mine.get(), std::memory_order_release);
    return mine.release();
  }
  return nullptr;
}

Status MapHoldsTensors(const FieldDescriptor* f) {
  return absl::InvalidArgumentError(absl::StrCat(
      "field ", f->full_name(),
      " is a map holding rdmarpc.Tensor values; tensors in maps are "
      "not supported (use a repeated message with a key field)"));
}

// Runs `walk` on the layout of `msg`'s class: cached, or computed for this
// walk (without a generated walker).
template <typename WalkFn>
Status WithLayout(const Message& msg, bool reflection_only, WalkFn walk) {
  if (!reflection_only) {
    if (const Layout* layout = CachedLayoutOf(msg)) return walk(*layout);
  }
  const Layout computed = ComputeLayout(msg);
  return walk(computed);
}

Status Walk(const Message& msg, const Layout& layout, const TensorWalk& at) {
  if (at.depth > kMaxDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("message nesting deeper than ", kMaxDepth));
  }
  if (layout.walker != nullptr) return layout.walker(msg, at);
  const Reflection* r = layout.reflection;
  std::vector<FieldStep> set;
  const std::vector<FieldStep>* fields = &layout.fields;
  if (layout.list_set_fields) {
    std::vector<const FieldDescriptor*> listed;
    r->ListFields(msg, &listed);  // set fields, in field-number order
    absl::flat_hash_set<const Descriptor*> seen;
    for (const FieldDescriptor* f : listed) {
      seen.clear();
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
          MayHoldTensor(f->message_type(), &seen)) {
        set.push_back(StepFor(f));
      }
    }
    fields = &set;
  }
  for (const FieldStep& step : *fields) {
    const FieldDescriptor* f = step.field;
    if (step.map) {
      if (r->FieldSize(msg, f) > 0) return MapHoldsTensors(f);
      continue;
    }
    auto visit = [&](const Message& sub) -> Status {
      if (step.tensor) {
        return generated::VisitTensor(at, step.number,
                                      static_cast<const Tensor&>(sub));
      }
      return generated::VisitMessage(at, step.number, sub);
    };
    if (step.repeated) {
      for (int i = 0, n = r->FieldSize(msg, f); i < n; ++i) {
        RDMARPC_RETURN_IF_ERROR(visit(r->GetRepeatedMessage(msg, f, i)));
      }
    } else if (r->HasField(msg, f)) {
      RDMARPC_RETURN_IF_ERROR(visit(r->GetMessage(msg, f)));
    }
  }
  return absl::OkStatus();
}

// `top`, when given, receives the top-level field number of each tensor.
Status WalkTop(const Message& msg, TensorList* out, TopFieldList* top,
               bool reflection_only) {
  out->clear();
  if (top != nullptr) top->clear();
  return WithLayout(msg, reflection_only, [&](const Layout& layout) -> Status {
    if (layout.is_tensor) {
      return absl::InvalidArgumentError(
          "a call's message cannot itself be an rdmarpc.Tensor; wrap it");
    }
    return Walk(msg, layout,
                {.out = out, .top = top, .reflection_only = reflection_only});
  });
}

}  // namespace

Status CollectTensors(const Message& msg, TensorList* out) {
  return WalkTop(msg, out, nullptr, false);
}

Status CollectTensorTopFields(const Message& msg, TopFieldList* out) {
  TensorList tensors;
  return WalkTop(msg, &tensors, out, false);
}

Status CollectMutableTensors(Message* msg, MutableTensorList* out,
                             TopFieldList* top) {
  // The walk only visits set fields, whose sub-messages are the objects
  // `msg` owns, so handing them out mutable is sound.
  TensorList found;
  RDMARPC_RETURN_IF_ERROR(WalkTop(*msg, &found, top, false));
  out->clear();
  out->reserve(found.size());
  for (const Tensor* t : found) out->push_back(const_cast<Tensor*>(t));
  return absl::OkStatus();
}

Status CollectTensorsByReflection(const Message& msg, TensorList* out,
                                  TopFieldList* top) {
  return WalkTop(msg, out, top, true);
}

bool WalksWithGeneratedWalker(const Message& msg) {
  const Layout* layout = CachedLayoutOf(msg);
  return layout != nullptr && layout->walker != nullptr;
}

namespace {

// Appends to `path` the way from `msg` down to `target`; false when it is
// not under `msg`.
bool FindTensorPath(const Message& msg, const Tensor* target, int depth,
                    std::string* path) {
  if (depth > kMaxDepth) return false;
  const Reflection* r = msg.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(msg, &fields);
  for (const FieldDescriptor* f : fields) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || f->is_map()) {
      continue;
    }
    const size_t before = path->size();
    const int count = f->is_repeated() ? r->FieldSize(msg, f) : 1;
    for (int i = 0; i < count; ++i) {
      const Message& child = f->is_repeated() ? r->GetRepeatedMessage(msg, f, i)
                                              : r->GetMessage(msg, f);
      absl::StrAppend(path, path->empty() ? "" : ".", f->name());
      if (f->is_repeated()) absl::StrAppend(path, "[", i, "]");
      if (&child == target || FindTensorPath(child, target, depth + 1, path)) {
        return true;
      }
      path->resize(before);
    }
  }
  return false;
}

}  // namespace

std::string TensorFieldPath(const Message& msg, const Tensor& tensor) {
  std::string path;
  if (!FindTensorPath(msg, &tensor, 0, &path)) return "";
  return path;
}

}  // namespace rdmarpc::internal

namespace rdmarpc::generated {

Status VisitTensor(const TensorWalk& walk, int field_number,
                   const Tensor& tensor) {
  walk.out->push_back(&tensor);
  if (walk.top != nullptr) {
    walk.top->push_back(walk.depth == 0 ? field_number : walk.top_field);
  }
  return absl::OkStatus();
}

Status VisitMessage(const TensorWalk& walk, int field_number,
                    const google::protobuf::Message& message) {
  TensorWalk below = walk;
  below.depth = walk.depth + 1;
  if (walk.depth == 0) below.top_field = field_number;
  return internal::WithLayout(message, walk.reflection_only,
                              [&](const internal::Layout& layout) {
                                return internal::Walk(message, layout, below);
                              });
}

Status MapHoldsTensors(const google::protobuf::Message& message,
                       int field_number) {
  return internal::MapHoldsTensors(
      message.GetDescriptor()->FindFieldByNumber(field_number));
}

bool RegisterTensorWalker(const std::type_info& type, TensorWalker walker) {
  internal::WalkerRegistry& registry = internal::Walkers();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.walkers.emplace(type, walker);
  return true;
}

}  // namespace rdmarpc::generated
