// HealthStatuses (transport/grpc/health.h): the health service's answers,
// its statuses, and what its watchers hear. Over a real gRPC port these
// run in tests/e2e/e2e_grpc.cc (HealthService.*).
#include "transport/grpc/health.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace rdmarpc::grpc_transport {
namespace {

std::string Request(const std::string& service) {
  std::string bytes;
  if (service.empty()) return bytes;
  bytes.push_back('\x0a');
  bytes.push_back(static_cast<char>(service.size()));
  return bytes + service;
}

// What a watcher heard, in order.
struct Recorder final : HealthWatcher {
  std::vector<std::pair<ServingStatus, bool>> heard;
  void OnHealth(ServingStatus status, bool final) override {
    heard.emplace_back(status, final);
  }
};

TEST(HealthStatuses, ChecksEachServiceAndSaysNotFoundForOthers) {
  HealthStatuses health({"demo.Inference"});
  EXPECT_EQ(*health.Check(Request("")),
            EncodeHealthResponse(ServingStatus::kServing));
  EXPECT_EQ(*health.Check(Request("demo.Inference")), "\x08\x01");
  auto missing = health.Check(Request("no.Such"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no.Such"), std::string::npos);

  health.Set("demo.Inference", false);
  EXPECT_EQ(*health.Check(Request("demo.Inference")), "\x08\x02");
  EXPECT_EQ(*health.Check(Request("")), "\x08\x01");
  // "" sets every service, as gRPC's SetServingStatus(bool) does.
  health.Set("", true);
  EXPECT_EQ(*health.Check(Request("demo.Inference")), "\x08\x01");
  health.Set("", false);
  EXPECT_EQ(*health.Check(Request("")), "\x08\x02");
  EXPECT_EQ(*health.Check(Request("demo.Inference")), "\x08\x02");
}

TEST(HealthStatuses, RequestsThatAreNotHealthRequestsAreInvalid) {
  HealthStatuses health({});
  // Field 1 as a varint, a length past the end, a group end with no start.
  for (std::string bad : {std::string("\x08\x01", 2), std::string("\x0a\x05x"),
                          std::string("\x0c")}) {
    EXPECT_EQ(health.Check(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << testing::PrintToString(bad);
  }
  // Unknown fields are skipped and the last service wins, as protobuf.
  EXPECT_EQ(*ParseHealthRequest(std::string("\x10\x07", 2) + Request("a") +
                                Request("bc")),
            "bc");
}

TEST(HealthStatuses, WatchersHearTheStatusThenEachChangeThenTheEnd) {
  HealthStatuses health({"demo.Inference"});
  Recorder known, unknown, other;
  health.Watch("demo.Inference", &known);
  health.Watch("later.Added", &unknown);
  health.Watch("", &other);
  health.Set("demo.Inference", false);
  health.Set("later.Added", true);
  health.Unwatch("", &other);
  health.Set("", true);
  health.Shutdown();
  health.Set("demo.Inference", true);  // ignored: the server stopped
  using S = ServingStatus;
  EXPECT_EQ(known.heard,
            (std::vector<std::pair<S, bool>>{{S::kServing, false},
                                             {S::kNotServing, false},
                                             {S::kServing, false},
                                             {S::kNotServing, true}}));
  EXPECT_EQ(unknown.heard,
            (std::vector<std::pair<S, bool>>{{S::kServiceUnknown, false},
                                             {S::kServing, false},
                                             {S::kServing, false},
                                             {S::kNotServing, true}}));
  // At shutdown a watcher of a service the server never knew hears
  // NOT_SERVING too (as in gRPC), while Check still says NOT_FOUND.
  Recorder never;
  HealthStatuses elsewhere({});
  elsewhere.Watch("no.Such", &never);
  elsewhere.Shutdown();
  elsewhere.Unwatch("no.Such", &never);
  EXPECT_EQ(never.heard,
            (std::vector<std::pair<S, bool>>{{S::kServiceUnknown, false},
                                             {S::kNotServing, true}}));
  EXPECT_EQ(elsewhere.Check(Request("no.Such")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(other.heard,
            (std::vector<std::pair<S, bool>>{{S::kServing, false}}));
  EXPECT_EQ(*health.Check(Request("demo.Inference")), "\x08\x02");

  // A watch that starts after the end hears the end at once.
  Recorder late;
  health.Watch("demo.Inference", &late);
  health.Unwatch("demo.Inference", &late);
  EXPECT_EQ(late.heard,
            (std::vector<std::pair<S, bool>>{{S::kNotServing, true}}));
}

}  // namespace
}  // namespace rdmarpc::grpc_transport
