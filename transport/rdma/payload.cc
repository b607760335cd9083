#include "transport/rdma/payload.h"

#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/tensor_walk.h"
#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

// Head bytes one Part may take: tags, two varints, a bool.
constexpr size_t kPartHeadBytes = 16;

std::span<const uint8_t> Bytes(const void* data, size_t size) {
  return {static_cast<const uint8_t*>(data), size};
}

}  // namespace

StatusOr<OutgoingPayload> PlanPayload(const google::protobuf::Message& msg,
                                      const CallTensors& tensors,
                                      size_t frame_room,
                                      uint64_t inline_threshold) {
  RDMARPC_ASSIGN_OR_RETURN(internal::OutgoingPlan plan,
                           internal::PlanOutgoing(msg, tensors));
  OutgoingPayload out;
  out.message = std::make_unique<std::string>();
  if (!msg.SerializeToString(out.message.get())) {
    return absl::InvalidArgumentError(
        "message cannot be serialized (over protobuf's 2 GiB limit without "
        "its tensors?)");
  }
  out.tensor_bytes = plan.total_bytes;
  size_t head_reserve = (plan.tensors.size() + 1) * kPartHeadBytes;
  size_t room = frame_room > head_reserve ? frame_room - head_reserve : 0;
  out.staged.reserve(plan.tensors.size());
  auto add = [&](const void* data, uint64_t size, bool may_inline,
                 bool in_message) {
    Part part;
    part.set_size(size);
    if (in_message) {
      part.set_in_message(true);
    } else if (may_inline && size <= room) {
      room -= size;
      out.inline_parts.push_back(Bytes(data, size));
    } else {
      part.set_out_of_band(true);
      out.out_of_band.push_back({data, size});
    }
    out.parts.push_back(std::move(part));
  };
  add(out.message->data(), out.message->size(), true, false);
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const internal::OutgoingTensor& t = plan.tensors[i];
    if (!t.out_of_band) {
      add(nullptr, t.size, false, true);
      continue;
    }
    bool may_inline = t.size <= inline_threshold && t.size <= room;
    const void* data = t.buffer.data();
    if (!t.buffer.device().is_host()) {
      if (!may_inline) {
        return absl::UnimplementedError(absl::StrCat(
            "tensor #", i, " lies in ", t.buffer.device().ToString(),
            " memory, which this build cannot register for RDMA"));
      }
      std::string& copy = out.staged.emplace_back(t.size, '\0');
      RDMARPC_RETURN_IF_ERROR(CopyBytes(copy.data(), Device::Host(),
                                        t.buffer.data(), t.buffer.device(),
                                        t.size));
      data = copy.data();
    }
    add(data, t.size, may_inline, false);
    if (may_inline) out.cpu_copied_bytes += t.size;
    out.keep.push_back(t.buffer);
  }
  return out;
}

StatusOr<uint64_t> GrantCallId(const FrameView& frame) {
  Grant probe;
  if (!probe.ParseFromArray(frame.head.data(),
                            static_cast<int>(frame.head.size()))) {
    return absl::InvalidArgumentError("grant head does not parse");
  }
  return probe.call_id();
}

StatusOr<int> WriteGrantedParts(const FrameView& frame,
                                const OutgoingPayload& out,
                                std::span<const LocalMemory> sources,
                                Connection* conn,
                                const std::function<void(Status)>& done) {
  RDMARPC_ASSIGN_OR_RETURN(Grant grant,
                           ParseGrant(frame, out.out_of_band.size()));
  for (int k = 0; k < grant.regions_size(); ++k) {
    if (grant.regions(k).length() != out.out_of_band[k].size) {
      return absl::InvalidArgumentError(
          absl::StrCat("grant region ", k, " holds ", grant.regions(k).length(),
                       " bytes for a part of ", out.out_of_band[k].size));
    }
  }
  int queued = 0;
  for (int k = 0; k < grant.regions_size(); ++k) {
    Connection::WriteRequest w;
    w.local = out.out_of_band[k].data;
    w.lkey = sources[k].lkey;
    w.remote_addr = grant.regions(k).addr();
    w.rkey = grant.regions(k).rkey();
    w.length = grant.regions(k).length();
    if (k + 1 == grant.regions_size()) w.immediate = grant.grant_id();
    if (!conn->Write(w, done).ok()) break;  // closed: the endpoint fails it
    ++queued;
  }
  return queued;
}

StatusOr<IncomingPayload> ReceivePayload(
    const google::protobuf::RepeatedPtrField<Part>& parts,
    std::string_view inline_bytes, uint64_t max_tensor_bytes,
    std::span<const TensorBuffer> supplied) {
  IncomingPayload in;
  in.parts.assign(parts.begin(), parts.end());
  in.inline_tensors.resize(parts.size() - 1);
  uint64_t tensor_total = 0;
  size_t offset = 0;
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const Part& p = in.parts[i];
    if (i == 0 && p.size() > INT_MAX) {
      return absl::ResourceExhaustedError(
          absl::StrCat("message part of ", p.size(),
                       " bytes exceeds protobuf's 2 GiB limit"));
    }
    if (i > 0) {
      if (p.size() > max_tensor_bytes - tensor_total) {
        return absl::ResourceExhaustedError(
            absl::StrCat("message tensors exceed the receiver's limit of ",
                         max_tensor_bytes, " bytes"));
      }
      tensor_total += p.size();
    }
    if (p.in_message()) continue;
    if (!p.out_of_band()) {
      std::string_view bytes = inline_bytes.substr(offset, p.size());
      offset += p.size();
      if (i == 0) {
        in.message.assign(bytes);
      } else {
        in.inline_tensors[i - 1].assign(bytes);
      }
    }
  }
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const Part& p = in.parts[i];
    if (!p.out_of_band()) continue;
    TensorBuffer landing;
    if (i > 0 && i - 1 < supplied.size() && !supplied[i - 1].empty()) {
      const TensorBuffer& s = supplied[i - 1];
      if (!s.device().is_host()) {
        return absl::UnimplementedError(absl::StrCat(
            "response tensor #", i - 1, ": a ", s.device().ToString(),
            " buffer cannot be registered for RDMA in this build"));
      }
      if (s.size() < p.size()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "response tensor #", i - 1, " is ", p.size(),
            " bytes; the buffer given with SetResponseTensorBuffer holds ",
            s.size()));
      }
      landing = s.Slice(0, p.size());
    } else {
      RDMARPC_ASSIGN_OR_RETURN(landing, TensorBuffer::Allocate(p.size()));
    }
    in.landing.push_back(std::move(landing));
    in.landing_part.push_back(i);
  }
  return in;
}

Status RegisterLandingMemory(IncomingPayload* in, ibv_pd* pd) {
  for (const TensorBuffer& landing : in->landing) {
    RDMARPC_ASSIGN_OR_RETURN(
        MemoryRegion mr, RegisterLanding(pd, landing.data(), landing.size()));
    in->landing_mrs.push_back(std::move(mr));
  }
  return absl::OkStatus();
}

void AddGrantRegions(const IncomingPayload& in, Grant* grant) {
  for (size_t k = 0; k < in.landing.size(); ++k) {
    Region* r = grant->add_regions();
    r->set_addr(reinterpret_cast<uintptr_t>(in.landing[k].data()));
    r->set_rkey(in.landing_mrs[k]->rkey);
    r->set_length(in.landing[k].size());
  }
}

StatusOr<internal::IncomingResult> FinishPayload(
    IncomingPayload* in, google::protobuf::Message* msg, Device placement,
    uint64_t max_tensor_bytes, std::shared_ptr<const void> owner,
    CallTensors* tensors) {
  // The grant ends here: the peer can no longer write into this memory.
  in->landing_mrs.clear();
  std::vector<TensorBuffer> landed(in->parts.size());
  for (size_t k = 0; k < in->landing.size(); ++k) {
    landed[in->landing_part[k]] = in->landing[k];
  }
  bool parsed = landed[0].empty()
                    ? msg->ParseFromString(in->message)
                    : msg->ParseFromArray(landed[0].data(),
                                          static_cast<int>(landed[0].size()));
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("message does not parse as ", msg->GetTypeName()));
  }
  std::vector<Tensor*> fields;
  RDMARPC_RETURN_IF_ERROR(internal::CollectMutableTensors(msg, &fields));
  if (fields.size() + 1 != in->parts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer announced ", in->parts.size() - 1,
                     " tensors but the message holds ", fields.size()));
  }
  std::vector<internal::IncomingPart> parts;
  parts.reserve(fields.size());
  uint64_t copied = 0;
  for (size_t i = 0; i < fields.size(); ++i) {
    const Part& p = in->parts[i + 1];
    if (!p.out_of_band() && !p.in_message()) {
      if (!fields[i]->data().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor #", i, ": sent in the frame and inside the message"));
      }
      fields[i]->set_data(std::move(in->inline_tensors[i]));
      copied += p.size();
    }
    parts.push_back({p.out_of_band(), p.size(), landed[i + 1]});
  }
  RDMARPC_ASSIGN_OR_RETURN(
      internal::IncomingResult result,
      internal::AcceptIncoming(msg, parts, placement, max_tensor_bytes,
                               std::move(owner), tensors));
  result.cpu_copied_bytes += copied;
  return result;
}

}  // namespace rdmarpc::rdma
