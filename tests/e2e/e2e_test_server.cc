// The e2e service in a process of its own, for tests that need a server
// they can freeze or kill: serves on 127.0.0.1:0 (gRPC only), allows
// keepalive pings every 100 ms, writes its port to the file named by its
// argument, and serves until killed.
#include <cstdio>
#include <fstream>

#include "e2e_fixture.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PORT_FILE\n", argv[0]);
    return 2;
  }
  rdmarpc_test::E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .EnableRdma(false)
                    .SetKeepalivePermit(std::chrono::milliseconds(100))
                    .BuildAndStart();
  if (!server.ok()) {
    std::fprintf(stderr, "e2e_test_server: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  // Written whole, then renamed: a reader never sees half a port.
  const std::string tmp = std::string(argv[1]) + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::rename(tmp.c_str(), argv[1]);
  (*server)->Wait();
  return 0;
}
