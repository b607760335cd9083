#include "runtime/codec.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/cuda_support.h"
#include "runtime/tensor_walk.h"

namespace rdmarpc::internal {
namespace {

// "tensor field 'input' (#0, f32, 1-d)": the field's path in `msg`, its
// walk index and description, for error messages.
std::string Describe(const google::protobuf::Message& msg, size_t index,
                     const Tensor& t) {
  std::string path = TensorFieldPath(msg, t);
  return absl::StrCat(
      path.empty() ? "tensor" : absl::StrCat("tensor field '", path, "'"),
      " (#", index, ", ", DTypeName(t.dtype()), ", ", t.shape_size(), "-d)");
}

StatusOr<uint64_t> ExpectedSize(const google::protobuf::Message& msg,
                                size_t index, const Tensor& t) {
  if (t.dtype() == DTYPE_UNSPECIFIED && t.shape_size() == 0 &&
      t.byte_size() == 0 && t.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Describe(msg, index, t),
        " is missing: the field is set but holds no tensor (no dtype); bind "
        "one with CallTensors::Set() or clear the field"));
  }
  auto size = TensorByteSize(
      t.dtype(), std::span<const int64_t>(t.shape().data(), t.shape().size()));
  if (!size.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(msg, index, t), ": ", size.status().message()));
  }
  if (t.byte_size() != 0 && t.byte_size() != *size) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(msg, index, t), ": byte_size ", t.byte_size(),
                     " does not match dtype and shape (", *size, " bytes)"));
  }
  return *size;
}

// Memory for a received tensor: device landing memory comes from the GPU's
// landing pool rather than a cudaMalloc per call.
StatusOr<TensorBuffer> AllocateOn(size_t size, Device device) {
  if (device.is_cuda()) return AllocateGpuLanding(device.index, size);
  return TensorBuffer::Allocate(size, device);
}

}  // namespace

StatusOr<OutgoingPlan> PlanOutgoing(const google::protobuf::Message& msg,
                                    const CallTensors& tensors) {
  TensorList fields;
  RDMARPC_RETURN_IF_ERROR(CollectTensors(msg, &fields));
  OutgoingPlan plan;
  plan.tensors.reserve(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) {
    const Tensor& t = *fields[i];
    RDMARPC_ASSIGN_OR_RETURN(uint64_t expected, ExpectedSize(msg, i, t));
    OutgoingTensor out;
    out.size = expected;
    if (const TensorBuffer* b = CallTensorsAccess::Find(tensors, t)) {
      if (!t.data().empty() || b->size() != expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            Describe(msg, i, t),
            ": the field changed after CallTensors::Set() (it has inline "
            "data or a shape that no longer matches the bound buffer)"));
      }
      out.out_of_band = true;
      out.buffer = *b;
    } else if (t.data().size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(msg, i, t), ": no buffer bound with CallTensors::Set() and ",
          t.data().size(), " inline bytes where dtype and shape need ",
          expected));
    }
    plan.total_bytes += expected;
    plan.tensors.push_back(std::move(out));
  }
  return plan;
}

StatusOr<std::vector<Device>> TensorPlacement::Resolve(
    const google::protobuf::Message& msg) const {
  TopFieldList fields;
  RDMARPC_RETURN_IF_ERROR(CollectTensorTopFields(msg, &fields));
  std::vector<Device> devices;
  devices.reserve(fields.size());
  for (int field : fields) devices.push_back(For(field));
  return devices;
}

Device TensorPlacement::For(int top_field) const {
  if (auto it = by_field.find(top_field); it != by_field.end()) {
    return it->second;
  }
  return device;
}

std::vector<Device> TensorPlacement::Devices() const {
  std::vector<Device> all{device};
  for (const auto& [field, d] : by_field) all.push_back(d);
  return all;
}

StatusOr<IncomingResult> AcceptIncoming(google::protobuf::Message* msg,
                                        std::span<const IncomingPart> parts,
                                        const TensorPlacement& where,
                                        uint64_t max_bytes,
                                        std::shared_ptr<const void> owner,
                                        CallTensors* tensors) {
  WalkedTensors walked;
  RDMARPC_RETURN_IF_ERROR(WalkForPlacement(msg, where, &walked));
  return AcceptIncoming(msg, walked, parts, where, max_bytes, std::move(owner),
                        tensors);
}

Status WalkForPlacement(google::protobuf::Message* msg,
                        const TensorPlacement& placement, WalkedTensors* out) {
  return CollectMutableTensors(
      msg, &out->fields, placement.by_field.empty() ? nullptr : &out->top);
}

StatusOr<IncomingResult> AcceptIncoming(google::protobuf::Message* msg,
                                        const WalkedTensors& walked,
                                        std::span<const IncomingPart> parts,
                                        const TensorPlacement& where,
                                        uint64_t max_bytes,
                                        std::shared_ptr<const void> owner,
                                        CallTensors* tensors) {
  const MutableTensorList& fields = walked.fields;
  if (!where.by_field.empty() && walked.top.size() != fields.size()) {
    return absl::InternalError("tensor fields walked without their top fields");
  }
  if (fields.size() != parts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer announced ", parts.size(),
                     " tensors but the message holds ", fields.size()));
  }
  IncomingResult result;
  // Check everything before allocating anything.
  for (size_t i = 0; i < fields.size(); ++i) {
    const Tensor& t = *fields[i];
    RDMARPC_ASSIGN_OR_RETURN(uint64_t expected, ExpectedSize(*msg, i, t));
    const IncomingPart& p = parts[i];
    if (p.size != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(*msg, i, t), ": peer announced ", p.size,
                       " bytes where dtype and shape need ", expected));
    }
    if (p.out_of_band && !t.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(*msg, i, t), ": sent out of band and inline at once"));
    }
    if (!p.out_of_band && t.data().size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(*msg, i, t), ": ", t.data().size(),
                       " inline bytes where dtype and shape need ", expected));
    }
    if (!p.landing.empty() && p.landing.size() < expected) {
      return absl::ResourceExhaustedError(
          absl::StrCat(Describe(*msg, i, t), " is ", expected,
                       " bytes; its landing buffer holds ", p.landing.size()));
    }
    if (expected > max_bytes - result.total_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("message tensors exceed the receiver's limit of ",
                       max_bytes, " bytes"));
    }
    result.total_bytes += expected;
    if (p.out_of_band) result.out_of_band_bytes += expected;
  }
  if (!fields.empty()) {
    if (!where.device.is_host()) {
      RDMARPC_RETURN_IF_ERROR(CudaDeviceStatus(where.device.index));
    }
    for (const auto& [field, d] : where.by_field) {
      if (!d.is_host()) RDMARPC_RETURN_IF_ERROR(CudaDeviceStatus(d.index));
    }
  }
  for (size_t i = 0; i < fields.size(); ++i) {
    Tensor& t = *fields[i];
    const IncomingPart& p = parts[i];
    const Device placement =
        where.by_field.empty() ? where.device : where.For(walked.top[i]);
    Device placement_of_bytes = placement;
    TensorBuffer bytes;
    if (!p.landing.empty()) {
      bytes = p.landing.Slice(0, p.size);
      const bool inline_copy = !p.out_of_band;
      if (bytes.device() != placement && !inline_copy) {
        // Landed elsewhere (host staging for a device placement): move it.
        RDMARPC_ASSIGN_OR_RETURN(TensorBuffer moved,
                                 AllocateOn(p.size, placement));
        RDMARPC_RETURN_IF_ERROR(CopyBytes(moved.data(), placement, bytes.data(),
                                          bytes.device(), p.size));
        result.cpu_copied_bytes += p.size;
        bytes = std::move(moved);
      } else if (inline_copy) {
        RDMARPC_RETURN_IF_ERROR(CopyBytes(bytes.data(), bytes.device(),
                                          t.data().data(), Device::Host(),
                                          p.size));
        result.cpu_copied_bytes += p.size;
        t.clear_data();
      }
      if (p.out_of_band) result.landing.push_back(bytes);
      placement_of_bytes = bytes.device();
    } else if (p.out_of_band) {
      RDMARPC_ASSIGN_OR_RETURN(bytes, AllocateOn(p.size, placement));
      result.landing.push_back(bytes);
    } else if (placement.is_host()) {
      bytes = TensorBuffer::Share(owner, t.data().data(), t.data().size());
    } else {
      RDMARPC_ASSIGN_OR_RETURN(bytes, AllocateOn(p.size, placement));
      RDMARPC_RETURN_IF_ERROR(CopyBytes(
          bytes.data(), placement, t.data().data(), Device::Host(), p.size));
      result.cpu_copied_bytes += p.size;
      t.clear_data();
    }
    t.set_device_type(placement_of_bytes.type);
    t.set_device_index(placement_of_bytes.index);
    t.set_byte_size(p.size);
    CallTensorsAccess::Bind(tensors, t, std::move(bytes));
  }
  return result;
}

namespace {

// Waits for a producer's CUDA stream before the first read of each GPU's
// memory: once for a stream (it belongs to one GPU), once per GPU for the
// legacy default stream.
class ProducerWait {
 public:
  explicit ProducerWait(void* cuda_stream) : stream_(cuda_stream) {}

  Status Before(Device device) {
    if (!device.is_cuda()) return absl::OkStatus();
    if (stream_ != nullptr ? waited_stream_
                           : std::find(waited_.begin(), waited_.end(),
                                       device.index) != waited_.end()) {
      return absl::OkStatus();
    }
    RDMARPC_ASSIGN_OR_RETURN(std::shared_ptr<CudaFence> fence,
                             CudaRecordFence(device.index, stream_));
    RDMARPC_RETURN_IF_ERROR(fence->Wait());
    waited_stream_ = true;
    waited_.push_back(device.index);
    return absl::OkStatus();
  }

 private:
  void* const stream_;
  bool waited_stream_ = false;
  std::vector<int> waited_;  // GPUs whose legacy stream was waited for
};

}  // namespace

Status WaitForGpuProducer(const OutgoingPlan& plan, void* cuda_stream) {
  ProducerWait wait(cuda_stream);
  for (const OutgoingTensor& t : plan.tensors) {
    if (t.out_of_band) RDMARPC_RETURN_IF_ERROR(wait.Before(t.buffer.device()));
  }
  return absl::OkStatus();
}

StatusOr<std::unique_ptr<google::protobuf::Message>> InlineTensors(
    const google::protobuf::Message& msg, const CallTensors& tensors,
    void* cuda_stream, uint64_t* copied) {
  ProducerWait wait(cuda_stream);
  TensorList fields;
  RDMARPC_RETURN_IF_ERROR(CollectTensors(msg, &fields));
  std::unique_ptr<google::protobuf::Message> copy(msg.New());
  copy->CopyFrom(msg);
  MutableTensorList copy_fields;
  RDMARPC_RETURN_IF_ERROR(CollectMutableTensors(copy.get(), &copy_fields));
  for (size_t i = 0; i < fields.size(); ++i) {
    const TensorBuffer* b = CallTensorsAccess::Find(tensors, *fields[i]);
    if (b == nullptr) continue;  // already inline
    RDMARPC_RETURN_IF_ERROR(wait.Before(b->device()));
    std::string* data = copy_fields[i]->mutable_data();
    data->resize(b->size());
    RDMARPC_RETURN_IF_ERROR(CopyBytes(data->data(), Device::Host(), b->data(),
                                      b->device(), b->size()));
    copy_fields[i]->set_device_type(DEVICE_TYPE_HOST);
    copy_fields[i]->set_device_index(0);
    *copied += b->size();
  }
  return copy;
}

}  // namespace rdmarpc::internal
