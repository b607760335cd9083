// Fuzz target for the RDMA frame decoder (transport/rdma/wire.h): any bytes a
// peer can SEND. Decoding and parsing must return a Status, never crash, and
// whatever parses must satisfy the checks the transport relies on. A request
// then goes the server's way: its parts received (ReceivePayload) and, as if
// every written part had landed, turned into a message with bound tensors
// (FinishPayload, the RDMA path into the codec's AcceptIncoming). A call
// head that parses encodes back to the very bytes it came in.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_seeds.h"
#include "google/protobuf/stubs/logging.h"
#include "runtime_test.pb.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/wire.h"

namespace {

using namespace rdmarpc::rdma;
using rdmarpc_runtime_test::Outer;

void CheckParts(const Parts& parts, const FrameView& frame) {
  uint64_t inline_total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    if (p.in_message) {
      // Bytes inside the message part: never part 0, never also written.
      if (i == 0 || p.out_of_band) std::abort();
      continue;
    }
    if (!p.out_of_band) inline_total += p.size;
  }
  if (parts.empty() || inline_total != frame.inline_bytes.size()) std::abort();
}

// The head's encoding is the one the peer sent.
void CheckEncodesBack(const FrameHead& head, const FrameView& frame) {
  std::vector<uint8_t> bytes(head.bytes());
  head.WriteTo(bytes.data());
  if (std::string_view(reinterpret_cast<const char*>(bytes.data()),
                       bytes.size()) != frame.head) {
    std::abort();
  }
}

Part MakePart(uint64_t size, bool out_of_band) {
  Part part;
  part.size = size;
  part.out_of_band = out_of_band;
  return part;
}

std::string Encode(FrameType type, const FrameHead& head,
                   std::string inline_bytes) {
  std::vector<uint8_t> out(4096);
  std::span<const uint8_t> part(
      reinterpret_cast<const uint8_t*>(inline_bytes.data()),
      inline_bytes.size());
  auto n = EncodeFrame(type, 3, head, {&part, 1}, out);
  if (!n.ok()) std::abort();
  return std::string(out.begin(), out.begin() + *n);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Protobuf logs what does not parse in a grant, cancel or ping head;
  // the parse fails and the status says so.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto frame = DecodeFrame(bytes);
  if (!frame.ok()) return 0;
  if (frame->head.size() + frame->inline_bytes.size() + kPreambleBytes !=
      size) {
    std::abort();
  }
  switch (frame->type) {
    case FrameType::kRequest:
      if (RequestHead head; ParseRequest(*frame, {}, &head).ok()) {
        const RequestHead* r = &head;
        CheckParts(r->parts, *frame);
        CheckEncodesBack(r, *frame);
        if (r->call_id == 0 || r->method.empty()) std::abort();
        // The receive side's plan for the parts: landing memory for each
        // written part, tensors within the budget whatever sizes the peer
        // claims. (A written message part may take up to 2 GiB; the
        // server's landing pool bounds it, so it is kept small here.)
        constexpr uint64_t kBudget = 1 << 20;
        if (r->parts[0].size <= kBudget) {
          const rdmarpc::internal::TensorPlacement host(
              rdmarpc::Device::Host());
          IncomingPayload in;
          if (ReceivePayload(r->parts, frame->inline_bytes, kBudget, {}, host,
                             &Outer::default_instance(),
                             {nullptr, rdmarpc::GpuRdmaMode::kAuto}, &in)
                  .ok()) {
            uint64_t landing = 0;
            for (const auto& b : in.landing) landing += b.size();
            if (landing > kBudget + r->parts[0].size) std::abort();
            Outer msg;
            rdmarpc::CallTensors tensors;
            auto done = FinishPayload(&in, &msg, host, kBudget, nullptr,
                                      &tensors, nullptr);
            if (done.ok() && done->total_bytes > kBudget) std::abort();
          }
        }
      }
      break;
    case FrameType::kResponse:
      if (ResponseHead head; ParseResponse(*frame, {}, &head).ok()) {
        CheckEncodesBack(&head, *frame);
        if (head.code == 0) CheckParts(head.parts, *frame);
      }
      break;
    case FrameType::kGrant:
      // A grant for 1 to 3 written parts.
      if (auto g = ParseGrant(*frame, 1 + size % 3); g.ok()) {
        if (g->regions_size() != static_cast<int>(1 + size % 3)) std::abort();
        for (const Region& r : g->regions()) {
          if (r.length() == 0) std::abort();
        }
      }
      break;
    case FrameType::kCancel:
      (void)ParseCancel(*frame);
      break;
    case FrameType::kCredit:
      if (!frame->head.empty()) std::abort();
      break;
    case FrameType::kPing:
    case FrameType::kPong:
      if (ParsePing(*frame).ok() && !frame->inline_bytes.empty()) std::abort();
      break;
  }
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  RequestHead request;
  request.call_id = 1;
  request.method = "/a.B/C";
  request.timeout_us = 5000;
  request.metadata.push_back({"k", "v"});
  request.parts.push_back(MakePart(3, false));
  request.parts.push_back(MakePart(1 << 20, true));
  // A request for an Outer message whose tensor travels in the frame.
  Outer outer;
  outer.mutable_first()->set_dtype(rdmarpc::DTYPE_U8);
  outer.mutable_first()->add_shape(3);
  outer.mutable_first()->set_byte_size(3);
  std::string message = outer.SerializeAsString();
  RequestHead with_tensor;
  with_tensor.call_id = 2;
  with_tensor.method = "/a.B/C";
  with_tensor.parts.push_back(MakePart(message.size(), false));
  with_tensor.parts.push_back(MakePart(3, false));
  ResponseHead response;
  response.call_id = 1;
  response.parts.push_back(MakePart(2, false));
  response.initial_metadata.push_back({"i", "1"});
  ResponseHead error;
  error.call_id = 1;
  error.code = 14;
  error.message = "unavailable";
  error.not_executed = true;
  error.trailing_metadata.push_back({"t", "2"});
  Grant grant;
  grant.set_call_id(1);
  grant.set_grant_id(9);
  for (int k = 0; k < 3; ++k) {
    auto* region = grant.add_regions();
    region->set_addr(4096 << k);
    region->set_rkey(5 + k);
    region->set_length((1 << 20) >> k);
  }
  Cancel cancel;
  cancel.set_call_id(1);
  Ping ping;
  ping.set_sequence(3);
  return {Encode(FrameType::kRequest, &request, "abc"),
          Encode(FrameType::kRequest, &with_tensor, message + "xyz"),
          Encode(FrameType::kResponse, &response, "hi"),
          Encode(FrameType::kResponse, &error, ""),
          Encode(FrameType::kGrant, &grant, ""),
          Encode(FrameType::kCancel, &cancel, ""),
          Encode(FrameType::kCredit, {}, ""),
          Encode(FrameType::kPing, &ping, "")};
}
