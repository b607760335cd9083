// A registration that fails for a low locked-memory limit: the call still
// completes, over gRPC, and says why. Runs as root in the VM, so it drops
// CAP_IPC_LOCK first (which otherwise exempts it from the limit); the
// capability is gone for the whole process, hence a binary of its own.
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "e2e_test.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace rdmarpc_test {
namespace {

class Sink final : public E2E::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse* resp) override {
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.tensor()));
    resp->set_note(std::to_string(in.size()));
    return absl::OkStatus();
  }
};

void DropIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  ASSERT_EQ(syscall(SYS_capget, &header, data), 0);
  const unsigned word = CAP_IPC_LOCK / 32, bit = 1u << (CAP_IPC_LOCK % 32);
  data[word].effective &= ~bit;
  data[word].permitted &= ~bit;
  data[word].inheritable &= ~bit;
  ASSERT_EQ(syscall(SYS_capset, &header, data), 0);
}

TEST(RdmaRegistration, LowMemlockLimitFallsBackToGrpcWithTheReason) {
  DropIpcLock();
  // Room for both sides' control buffers (4 MiB each), not for 32 MiB.
  rlimit limit{12 << 20, 12 << 20};
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &limit), 0);
  Sink sink;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&sink)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  // Timers for a loaded machine (a sanitized build in the TCG VM): the
  // default peer timeout (3 s) once took the first call's slow start for
  // a silent server and moved it to gRPC. This test is about registration.
  rdmarpc::ChannelOptions options;
  options.rdma_connect_timeout = std::chrono::seconds(60);
  options.rdma_peer_timeout = std::chrono::seconds(20);
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
  // A small call: RDMA works within the limit.
  {
    std::vector<uint8_t> small(64 << 10, 1);
    rdmarpc::ClientContext ctx;
    EchoRequest req;
    ASSERT_TRUE(
        ctx.tensors()
            .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                 {static_cast<int64_t>(small.size())},
                 rdmarpc::TensorBuffer::Borrow(small.data(), small.size()))
            .ok());
    EchoResponse resp;
    ASSERT_TRUE(stub->Echo(&ctx, req, &resp).ok());
    EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma)
        << ctx.stats().transport_reason;
  }
  std::vector<uint8_t> big(32 << 20, 2);
  rdmarpc::ClientContext ctx;
  EchoRequest req;
  ASSERT_TRUE(ctx.tensors()
                  .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                       {static_cast<int64_t>(big.size())},
                       rdmarpc::TensorBuffer::Borrow(big.data(), big.size()))
                  .ok());
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), std::to_string(big.size()));
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kGrpc);
  const std::string& why = ctx.stats().transport_reason;
  EXPECT_NE(why.find("locked-memory limit is 12 MB"), std::string::npos) << why;
  EXPECT_NE(why.find("ulimit -l"), std::string::npos) << why;
  EXPECT_NE(why.find("gRPC carries the call"), std::string::npos) << why;
}

}  // namespace
}  // namespace rdmarpc_test
