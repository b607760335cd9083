// RDMA call benchmarks, run where an RDMA device is (the soft-RoCE VM via
// bench/rdma_vs_perftest.sh):
//   rdma_calls latency [bytes...]    small-call round trips, p50/p99 in us
//   rdma_calls throughput MiB [n]    one-way tensor throughput, MB/s
//   rdma_calls threshold             round trip per size, inline vs written
// Each line is one result: "name value unit".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "e2e_test.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace {

using Clock = std::chrono::steady_clock;

class Sink final : public rdmarpc_test::E2E::Service {
 public:
  // Echo without the tensor: the request's bytes travel, a small reply
  // comes back.
  rdmarpc::Status Echo(rdmarpc::ServerContext*,
                       const rdmarpc_test::EchoRequest& req,
                       rdmarpc_test::EchoResponse* resp) override {
    resp->set_note(req.note());
    return absl::OkStatus();
  }
};

struct Setup {
  Sink sink;
  int port = 0;
  std::unique_ptr<rdmarpc::Server> server;
};

std::unique_ptr<rdmarpc_test::E2E::Stub> Connect(Setup* s, uint64_t threshold) {
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &s->port)
                    .RegisterService(&s->sink)
                    .BuildAndStart();
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  s->server = std::move(*server);
  rdmarpc::ChannelOptions options;
  options.policy = rdmarpc::TransportPolicy::kRdma;
  options.rdma_inline_threshold = threshold;
  return rdmarpc_test::E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(s->port), options));
}

// Round trip times in microseconds, sorted.
std::vector<double> RoundTrips(rdmarpc_test::E2E::Stub* stub, size_t bytes,
                               int calls) {
  std::vector<uint8_t> data(bytes, 7);
  std::vector<double> us;
  for (int i = 0; i < calls + 20; ++i) {
    rdmarpc::ClientContext ctx;
    rdmarpc_test::EchoRequest req;
    if (bytes > 0) {
      (void)ctx.tensors().Set(
          req.mutable_tensor(), rdmarpc::DTYPE_U8,
          {static_cast<int64_t>(bytes)},
          rdmarpc::TensorBuffer::Borrow(data.data(), data.size()));
    }
    rdmarpc_test::EchoResponse resp;
    auto start = Clock::now();
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    double t =
        std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (!s.ok() || ctx.stats().transport != rdmarpc::TransportKind::kRdma) {
      std::fprintf(stderr, "call failed or not RDMA: %s\n",
                   s.ToString().c_str());
      std::exit(1);
    }
    if (i >= 20) us.push_back(t);  // warm-up excluded
  }
  std::sort(us.begin(), us.end());
  return us;
}

double Pct(const std::vector<double>& v, double p) {
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "latency";
  Setup setup;
  if (mode == "latency") {
    auto stub = Connect(&setup, 0);
    std::vector<size_t> sizes;
    for (int i = 2; i < argc; ++i)
      sizes.push_back(std::strtoull(argv[i], nullptr, 10));
    if (sizes.empty()) sizes = {0, 64, 4096};
    for (size_t size : sizes) {
      auto us = RoundTrips(stub.get(), size, 1000);
      std::printf("rtt_p50_%zuB %.1f us\nrtt_p99_%zuB %.1f us\n", size,
                  Pct(us, 0.5), size, Pct(us, 0.99));
    }
  } else if (mode == "throughput") {
    size_t mib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 64;
    int n = argc > 3 ? std::atoi(argv[3]) : 8;
    auto stub = Connect(&setup, 0);
    size_t bytes = mib << 20;
    std::vector<uint8_t> data(bytes, 1);
    (void)rdmarpc::RegisterMemoryForRdma(data.data(), data.size());
    RoundTrips(stub.get(), bytes, 1);  // registration and warm-up
    auto start = Clock::now();
    for (int i = 0; i < n; ++i) {
      rdmarpc::ClientContext ctx;
      rdmarpc_test::EchoRequest req;
      (void)ctx.tensors().Set(
          req.mutable_tensor(), rdmarpc::DTYPE_U8,
          {static_cast<int64_t>(bytes)},
          rdmarpc::TensorBuffer::Borrow(data.data(), data.size()));
      rdmarpc_test::EchoResponse resp;
      if (!stub->Echo(&ctx, req, &resp).ok()) return 1;
    }
    double s = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("tensor_%zuMiB %.1f MB/s\n", mib, n * bytes / s / 1e6);
  } else if (mode == "threshold") {
    // Round trip of one request tensor per size, sent in the SEND and sent
    // by RDMA WRITE after a grant.
    auto inline_stub = Connect(&setup, uint64_t{1} << 20);
    Setup written_setup;
    auto written_stub = Connect(&written_setup, 1);
    for (size_t size : {256, 1024, 2048, 4096, 8192, 12288, 16384, 24576}) {
      auto a = RoundTrips(inline_stub.get(), size, 300);
      auto b = RoundTrips(written_stub.get(), size, 300);
      std::printf("threshold_%zuB inline_p50 %.1f us written_p50 %.1f us\n",
                  size, Pct(a, 0.5), Pct(b, 0.5));
    }
  } else {
    std::fprintf(stderr, "usage: %s latency|throughput|threshold\n", argv[0]);
    return 2;
  }
  return 0;
}
