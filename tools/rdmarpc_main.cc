// The `rdmarpc` command.
//
//   rdmarpc doctor [--peer=HOST]     what this host offers, each problem
//                                    with its fix; exit 1 if any
//   rdmarpc ping HOST:PORT [--count=N] [--policy=auto|rdma|grpc]
//                [--size=BYTES]      calls rdmarpc.Diagnostics/Ping on a
//                                    server and prints, per call, the
//                                    transport, why, and the round trip
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "rdmarpc/channel.h"
#include "rdmarpc/diagnostics.pb.h"
#include "tools/doctor.h"

namespace {

constexpr char kUsage[] =
    "usage:\n"
    "  rdmarpc doctor [--peer=HOST]\n"
    "      reports this host's RDMA devices, ports, GIDs and MTUs, the\n"
    "      address a server here listens on for RDMA, the locked-memory\n"
    "      limit, GPUs and their RDMA mode, and (with --peer) whether\n"
    "      rdma_cm routes to HOST; each problem with its fix. Exit 1 if\n"
    "      there is any.\n"
    "  rdmarpc ping HOST:PORT [--count=N] [--policy=auto|rdma|grpc] "
    "[--size=BYTES]\n"
    "      calls the server's rdmarpc.Diagnostics/Ping N times (default 5)\n"
    "      and prints the transport each call took, why, and its round\n"
    "      trip. Exit 1 if a call fails.\n";

// "--name=value" -> value, when `arg` is that flag.
bool Flag(std::string_view arg, std::string_view name, std::string* value) {
  if (arg.rfind(name, 0) != 0 || arg.size() <= name.size() ||
      arg[name.size()] != '=') {
    return false;
  }
  *value = std::string(arg.substr(name.size() + 1));
  return true;
}

int Usage(const std::string& error) {
  std::cerr << "rdmarpc: " << error << "\n" << kUsage;
  return 2;
}

bool ParseCount(const std::string& text, long max, long* out) {
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || n < 0 || n > max) {
    return false;
  }
  *out = n;
  return true;
}

int Doctor(const std::vector<std::string>& args) {
  rdmarpc::tools::DoctorOptions options;
  for (const std::string& arg : args) {
    if (!Flag(arg, "--peer", &options.peer)) {
      return Usage("doctor: unknown argument " + arg);
    }
  }
  rdmarpc::tools::DoctorReport report = rdmarpc::tools::RunDoctor(options);
  std::cout << report.text;
  return report.problems.empty() ? 0 : 1;
}

int Ping(const std::vector<std::string>& args) {
  std::string target, value;
  long count = 5, size = 0;
  rdmarpc::ChannelOptions options;
  for (const std::string& arg : args) {
    if (Flag(arg, "--count", &value)) {
      if (!ParseCount(value, 1000000, &count) || count == 0) {
        return Usage("ping: --count takes a number from 1 to 1000000");
      }
    } else if (Flag(arg, "--size", &value)) {
      if (!ParseCount(value, 64 << 20, &size)) {
        return Usage("ping: --size takes bytes from 0 to 67108864");
      }
    } else if (Flag(arg, "--policy", &value)) {
      if (value == "auto") {
        options.policy = rdmarpc::TransportPolicy::kAuto;
      } else if (value == "rdma") {
        options.policy = rdmarpc::TransportPolicy::kRdma;
      } else if (value == "grpc") {
        options.policy = rdmarpc::TransportPolicy::kGrpc;
      } else {
        return Usage("ping: --policy is auto, rdma or grpc, not " + value);
      }
    } else if (!arg.empty() && arg[0] != '-' && target.empty()) {
      target = arg;
    } else {
      return Usage("ping: unknown argument " + arg);
    }
  }
  if (target.empty()) return Usage("ping: give the server as HOST:PORT");

  auto channel = rdmarpc::CreateChannel(target, options);
  rdmarpc::PingRequest request;
  request.set_payload(std::string(static_cast<size_t>(size), 'p'));
  std::vector<double> round_trips_us;
  int rdma_calls = 0;
  for (long i = 1; i <= count; ++i) {
    rdmarpc::ClientContext ctx;
    ctx.set_timeout(std::chrono::seconds(10));
    rdmarpc::PingResponse response;
    auto start = std::chrono::steady_clock::now();
    rdmarpc::Status status =
        channel->Call("/rdmarpc.Diagnostics/Ping", &ctx, request, &response);
    double us = std::chrono::duration<double, std::micro>(
                    std::chrono::steady_clock::now() - start)
                    .count();
    const rdmarpc::CallStats& stats = ctx.stats();
    if (!status.ok()) {
      std::cout << "ping " << i << ": failed: " << status << "\n";
      return 1;
    }
    if (response.payload().size() != request.payload().size()) {
      std::cout << "ping " << i << ": the server echoed "
                << response.payload().size() << " bytes of "
                << request.payload().size() << "\n";
      return 1;
    }
    round_trips_us.push_back(us);
    if (stats.transport == rdmarpc::TransportKind::kRdma) ++rdma_calls;
    std::cout << "ping " << i << ": " << static_cast<long>(us) << " us over "
              << rdmarpc::TransportName(stats.transport) << ", because "
              << stats.transport_reason << "\n";
    if (i == 1) {
      std::cout << "  server: received it over " << response.served_over()
                << "; its RDMA: " << response.server_rdma() << "\n";
    }
  }
  std::vector<double> sorted = round_trips_us;
  std::sort(sorted.begin(), sorted.end());
  std::cout << count << " calls to " << target << ": " << rdma_calls
            << " over rdma, " << count - rdma_calls
            << " over grpc; round trip min " << static_cast<long>(sorted[0])
            << " us, median " << static_cast<long>(sorted[sorted.size() / 2])
            << " us, max " << static_cast<long>(sorted.back())
            << " us (the first call includes connection setup)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage("give a command");
  const std::string command = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "doctor") return Doctor(args);
  if (command == "ping") return Ping(args);
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kUsage;
    return 0;
  }
  return Usage("unknown command " + command);
}
