// hello_tensor_client: calls hello.TensorService/Scale with tensors of a few
// sizes and prints, per call, the transport that carried it and why.
//
//   hello_tensor_client [--target=localhost:50051] [--policy=auto|rdma|grpc]
//                       [--device=host|cuda] [--verbose]
//                       [--rounds=N [--wait-between-rounds]]
//
// --device=cuda sends the input from, and lands the output in, GPU 0's
// memory, and prints how RDMA reached it (dma-buf, peer-memory, staging).
//
// --verbose also prints the channel's transport health at the end: its
// state, switches between RDMA and gRPC, the last trigger and calls per
// transport.
//
// --rounds=N makes the calls N times on one channel, printing the channel's
// RDMA health before each round; with --wait-between-rounds it first reads
// a line from stdin, and a line "await-rdma" makes it wait (up to 20 s)
// for the channel to be back on RDMA. scripts/run_example.sh --vm drives
// it that way to show a fallback and the fail-back.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "hello_tensor.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace {

// Makes the calls of one round; returns how many failed.
int RunRound(hello::TensorService::Stub* stub, rdmarpc::Device device,
             bool first_round) {
  int failures = 0;
  int call = 0;
  for (size_t elements :
       {size_t{4}, size_t{1} << 10, size_t{1} << 20, size_t{16} << 20}) {
    ++call;
    std::vector<float> input(elements);
    for (size_t i = 0; i < elements; ++i)
      input[i] = static_cast<float>(i % 1000);
    const size_t bytes = input.size() * sizeof(float);
    rdmarpc::ClientContext ctx;
    ctx.set_timeout(std::chrono::seconds(30));
    ctx.set_response_placement(device);
    hello::ScaleRequest req;
    req.set_name("hello_tensor_client");
    req.set_factor(2.0f);
    auto buffer = rdmarpc::TensorBuffer::Allocate(bytes, device);
    rdmarpc::Status s = buffer.status();
    if (s.ok()) {
      s = rdmarpc::CopyBytes(buffer->data(), device, input.data(),
                             rdmarpc::Device::Host(), bytes);
    }
    if (s.ok()) {
      s = ctx.tensors().Set(req.mutable_input(), rdmarpc::DTYPE_F32,
                            {static_cast<int64_t>(elements)}, *buffer);
    }
    hello::ScaleResponse resp;
    if (s.ok()) s = stub->Scale(&ctx, req, &resp);
    std::string verdict;
    if (s.ok()) {
      auto out = ctx.tensors().Get(resp.output());
      std::vector<float> got(elements);
      bool right = out.ok() && out->size() == bytes &&
                   rdmarpc::CopyBytes(got.data(), rdmarpc::Device::Host(),
                                      out->data(), out->device(), bytes)
                       .ok();
      for (size_t i = 0; right && i < elements; ++i) {
        right = got[i] == input[i] * 2.0f;
      }
      verdict = right ? "ok, output checked" : "WRONG OUTPUT";
      if (!right) ++failures;
    } else {
      verdict = "failed: " + s.ToString();
      ++failures;
    }
    const rdmarpc::CallStats& st = ctx.stats();
    std::printf(
        "call %d: Scale(%zu floats, %zu bytes) -> %s\n"
        "  transport: %s, because %s\n"
        "  tensor bytes sent %llu, received %llu, copied by CPU %llu\n",
        call, elements, elements * sizeof(float), verdict.c_str(),
        rdmarpc::TransportName(st.transport), st.transport_reason.c_str(),
        static_cast<unsigned long long>(st.tensor_bytes_sent),
        static_cast<unsigned long long>(st.tensor_bytes_received),
        static_cast<unsigned long long>(st.cpu_copied_bytes));
    if (device.is_cuda()) {
      std::printf(
          "  GPU memory: %s\n",
          st.gpu_rdma_mode.empty()
              ? "not over RDMA (gRPC stages it through host memory)"
              : (st.gpu_rdma_mode + ", because " + st.gpu_rdma_reason).c_str());
    }
    if (s.ok() && call == 1 && first_round) {
      std::printf("  server said: %s\n", resp.greeting().c_str());
      std::string metadata;
      for (const auto& [k, v] : ctx.GetServerInitialMetadata()) {
        metadata += " " + k + "=" + v + " (initial)";
      }
      for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
        metadata += " " + k + "=" + v + " (trailing)";
      }
      std::printf("  server metadata:%s\n", metadata.c_str());
    }
  }
  std::fflush(stdout);
  return failures;
}

// The channel's RDMA health in one line.
std::string HealthLine(rdmarpc::Channel& channel) {
  rdmarpc::ChannelTransportStats t = channel.transport_stats();
  std::string line = std::string("channel: ") + RdmaHealthName(t.health) +
                     ", " + std::to_string(t.switches) + " switch(es)";
  if (!t.last_trigger.empty()) {
    line += "; last trigger: " + t.last_trigger + " (" + t.last_error + ")";
  }
  return line;
}

// Waits up to `limit` for the channel to be back on RDMA.
void AwaitRdma(rdmarpc::Channel& channel, std::chrono::milliseconds limit) {
  const auto start = std::chrono::steady_clock::now();
  while (channel.transport_stats().health != rdmarpc::RdmaHealth::kReady &&
         std::chrono::steady_clock::now() - start < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::printf("(waited %lld ms for the channel's probe to reach RDMA)\n",
              static_cast<long long>(waited.count()));
}

}  // namespace

int main(int argc, char** argv) {
  std::string target = "localhost:50051";
  std::string policy_name = "auto";
  bool verbose = false;
  int rounds = 1;
  bool wait_between_rounds = false;
  rdmarpc::Device device = rdmarpc::Device::Host();
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--target=", 0) == 0) {
      target = arg.substr(9);
    } else if (arg.rfind("--policy=", 0) == 0) {
      policy_name = arg.substr(9);
    } else if (arg == "--device=host") {
      device = rdmarpc::Device::Host();
    } else if (arg == "--device=cuda") {
      device = rdmarpc::Device::Cuda(0);
    } else if (arg == "--verbose") {
      verbose = true;
    } else if (arg.rfind("--rounds=", 0) == 0 &&
               std::sscanf(arg.c_str() + 9, "%d", &rounds) == 1 &&
               rounds >= 1) {
      // parsed by the condition
    } else if (arg == "--wait-between-rounds") {
      wait_between_rounds = true;
    } else {
      std::cerr << "usage: " << argv[0]
                << " [--target=host:port] [--policy=auto|rdma|grpc]"
                   " [--device=host|cuda] [--verbose]"
                   " [--rounds=N [--wait-between-rounds]]\n";
      return 2;
    }
  }
  if (device.is_cuda()) {
    rdmarpc::Status gpu = rdmarpc::CudaDeviceStatus(device.index);
    if (!gpu.ok()) {
      std::cerr << "hello_tensor_client: --device=cuda: " << gpu.message()
                << "\n";
      return 2;
    }
  }
  auto policy = rdmarpc::ParsePolicy(policy_name);
  if (!policy.ok()) {
    std::cerr << "hello_tensor_client: " << policy.status() << "\n";
    return 2;
  }
  rdmarpc::ChannelOptions options;
  options.policy = *policy;
  auto channel = rdmarpc::CreateChannel(target, options);
  auto stub = hello::TensorService::NewStub(channel);

  int failures = 0;
  for (int round = 1; round <= rounds; ++round) {
    if (rounds > 1) {
      if (round > 1 && wait_between_rounds) {
        std::string line;
        if (std::getline(std::cin, line) && line == "await-rdma") {
          AwaitRdma(*channel, std::chrono::seconds(20));
        }
      }
      std::printf("round %d: %s\n", round, HealthLine(*channel).c_str());
    }
    failures += RunRound(stub.get(), device, round == 1);
  }
  std::printf("%d calls, %d failed\n", 4 * rounds, failures);
  if (verbose) {
    std::printf("channel transport health:\n%s",
                channel->transport_stats().ToString().c_str());
  }
  return failures == 0 ? 0 : 1;
}
