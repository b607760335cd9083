// hello_tensor_server: serves hello.TensorService/Scale.
//
//   hello_tensor_server [--port=50051] [--port-file=PATH]
//
// Prints the port it listens on; with --port-file also writes it there (so
// scripts can start it on port 0).
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include "hello_tensor.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace {

class ScaleService final : public hello::TensorService::Service {
 public:
  rdmarpc::Status Scale(rdmarpc::ServerContext* ctx,
                        const hello::ScaleRequest& req,
                        hello::ScaleResponse* resp) override {
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.input()));
    if (in.dtype() != rdmarpc::DTYPE_F32) {
      return absl::InvalidArgumentError("input must be an f32 tensor");
    }
    // The input lands where the server placed it: its GPU when it has one
    // (the default), else host memory. This handler scales on the CPU and
    // answers from the same device the input came in on.
    const rdmarpc::Device device = in.device();
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorBuffer host,
                             rdmarpc::TensorBuffer::Allocate(in.size()));
    RDMARPC_RETURN_IF_ERROR(rdmarpc::CopyBytes(
        host.data(), rdmarpc::Device::Host(), in.data(), device, in.size()));
    float* values = static_cast<float*>(host.data());
    for (size_t i = 0; i < in.size() / sizeof(float); ++i) {
      values[i] *= req.factor();
    }
    rdmarpc::TensorBuffer out = host;
    if (device.is_cuda()) {
      RDMARPC_ASSIGN_OR_RETURN(
          out, rdmarpc::TensorBuffer::Allocate(in.size(), device));
      RDMARPC_RETURN_IF_ERROR(rdmarpc::CopyBytes(
          out.data(), device, host.data(), rdmarpc::Device::Host(), in.size()));
    }
    // Metadata for the client, as gRPC sends it: initial ahead of the
    // response, trailing after it.
    RDMARPC_RETURN_IF_ERROR(
        ctx->AddInitialMetadata("x-input-device", device.ToString()));
    RDMARPC_RETURN_IF_ERROR(ctx->AddTrailingMetadata(
        "x-served-over", rdmarpc::TransportName(ctx->transport())));
    resp->set_greeting("hello, " + req.name() + " (served over " +
                       rdmarpc::TransportName(ctx->transport()) +
                       ", input landed in " + device.ToString() + " memory)");
    return ctx->tensors().Set(resp->mutable_output(), rdmarpc::DTYPE_F32,
                              in.shape(), std::move(out));
  }
};

volatile std::sig_atomic_t g_stop = 0;

}  // namespace

int main(int argc, char** argv) {
  std::string port = "50051";
  std::string port_file;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--port=", 0) == 0) {
      port = arg.substr(7);
    } else if (arg.rfind("--port-file=", 0) == 0) {
      port_file = arg.substr(12);
    } else {
      std::cerr << "usage: " << argv[0] << " [--port=N] [--port-file=PATH]\n";
      return 2;
    }
  }
  ScaleService service;
  int bound = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("0.0.0.0:" + port, &bound)
                    .RegisterService(&service)
                    // grpcurl and other gRPC tools can list and call it.
                    .EnableReflection(true)
                    .BuildAndStart();
  if (!server.ok()) {
    std::cerr << "hello_tensor_server: " << server.status() << "\n";
    return 1;
  }
  std::cout << "hello_tensor_server listening on port " << bound << std::endl;
  if (!port_file.empty()) std::ofstream(port_file) << bound << "\n";
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  while (!g_stop) pause();
  std::cout << "hello_tensor_server: shutting down" << std::endl;
  (*server)->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(2));
  return 0;
}
