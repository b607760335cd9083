// Fuzz target for the health service's decoder (transport/grpc/health.h):
// the input is a HealthCheckRequest from a peer, for Check and for Watch.
// Check must return a Status, never crash; an answer must be one of the
// two statuses Check reports, and a request it takes must name a service.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_seeds.h"
#include "transport/grpc/health.h"

namespace {

using rdmarpc::grpc_transport::EncodeHealthResponse;
using rdmarpc::grpc_transport::HealthStatuses;
using rdmarpc::grpc_transport::ServingStatus;

HealthStatuses& Health() {
  static auto* health = [] {
    auto* h = new HealthStatuses({"demo.Inference", "demo.Other"});
    h->Set("demo.Other", false);
    return h;
  }();
  return *health;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view request(reinterpret_cast<const char*>(data), size);
  auto answer = Health().Check(request);
  if (answer.ok() && *answer != EncodeHealthResponse(ServingStatus::kServing) &&
      *answer != EncodeHealthResponse(ServingStatus::kNotServing)) {
    std::abort();
  }
  auto service = rdmarpc::grpc_transport::ParseHealthRequest(request);
  if (answer.ok() && !service.ok()) std::abort();
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  return {"", std::string("\x0a\x0e") + "demo.Inference",
          std::string("\x0a\x0a") + "demo.Other", std::string("\x0a\x03xyz"),
          std::string("\x10\x01\x0a\x00", 4)};
}
