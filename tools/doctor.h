// `rdmarpc doctor`: what this host offers rdmarpc, and why a call from or
// to it would take gRPC/TCP instead of RDMA.
//
// It reads the facts the runtime itself decides on: RDMA devices and their
// ports, the address a server here would listen on, the locked-memory limit
// against what connections register, the GPUs and which GPU RDMA mode each
// (GPU, device) pair would get, and, given a peer, whether rdma_cm routes to
// it. Each problem comes with its fix in one line.
//
//   DoctorReport report = RunDoctor({.peer = "10.0.0.7"});
//   std::cout << report.text;
//   return report.problems.empty() ? 0 : 1;
#ifndef RDMARPC_TOOLS_DOCTOR_H_
#define RDMARPC_TOOLS_DOCTOR_H_

#include <string>
#include <vector>

namespace rdmarpc::tools {

struct DoctorOptions {
  // A host (name or IPv4 address) to resolve and route to with rdma_cm;
  // empty: none.
  std::string peer;
};

struct DoctorReport {
  std::string text;  // the whole report, problems and verdict included
  // "<what is wrong>. Fix: <what to do>", one line each.
  std::vector<std::string> problems;
  // Whether a server here would offer RDMA and a client here could use it.
  bool rdma_usable = false;
};

DoctorReport RunDoctor(const DoctorOptions& options);

}  // namespace rdmarpc::tools

#endif  // RDMARPC_TOOLS_DOCTOR_H_
