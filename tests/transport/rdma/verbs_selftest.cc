// Our own code on real verbs (label rdma: runs through tests/rdma_vm/run.sh,
// natively on an RDMA NIC or in the soft-RoCE VM). Opens the device,
// registers memory, connects two RC queue pairs through librdmacm, and checks
// SEND/RECV and RDMA WRITE WITH IMMEDIATE byte for byte.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{10000};
constexpr char kHello[] = "rdmarpc-verbs-selftest";
constexpr int kAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

#define ASSERT_OK_AND_ASSIGN(lhs, expr)            \
  auto lhs##_or = (expr);                          \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

// One side of the connection. Members in creation order: destruction runs
// in reverse, queue pair before id.
struct Endpoint {
  CmId id;
  ProtectionDomain pd;
  CompletionQueue cq;
  CmQueuePair qp;
  std::vector<uint8_t> buffer;
  MemoryRegion mr;

  Status Setup(size_t buffer_bytes) {
    RDMARPC_ASSIGN_OR_RETURN(pd, AllocatePd(id->verbs));
    RDMARPC_ASSIGN_OR_RETURN(cq, CreateCq(id->verbs, 64));
    RDMARPC_ASSIGN_OR_RETURN(qp, CreateRcQp(id.get(), pd.get(), cq.get(), {}));
    buffer.assign(buffer_bytes, 0);
    RDMARPC_ASSIGN_OR_RETURN(
        mr, RegisterMemory(pd.get(), buffer.data(), buffer.size(), kAccess));
    return absl::OkStatus();
  }

  Status PostRecv(size_t offset, size_t length, uint64_t wr_id) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buffer.data() + offset),
                static_cast<uint32_t>(length), mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = length > 0 ? 1 : 0;
    ibv_recv_wr* bad = nullptr;
    int err = ibv_post_recv(qp.get(), &wr, &bad);
    return err == 0 ? absl::OkStatus() : VerbsError("ibv_post_recv", err);
  }

  Status PostSend(size_t offset, size_t length, uint64_t wr_id) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buffer.data() + offset),
                static_cast<uint32_t>(length), mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    int err = ibv_post_send(qp.get(), &wr, &bad);
    return err == 0 ? absl::OkStatus() : VerbsError("ibv_post_send", err);
  }
};

// What the receiver grants for a one-sided write.
struct Grant {
  uint64_t addr;
  uint32_t rkey;
  uint32_t length;
};

class VerbsSelfTest : public ::testing::Test {
 protected:
  static constexpr size_t kBufferBytes = 16 << 20;

  void SetUp() override {
    for (const std::string& d : DescribeRdmaDevices()) {
      std::printf("device: %s\n", d.c_str());
    }
    ASSERT_OK_AND_ASSIGN(addr, FindRdmaIpv4Address());
    address_ = addr;

    // Server: listen on an ephemeral port of the RDMA address.
    ASSERT_OK_AND_ASSIGN(server_events, CreateEventChannel());
    server_events_ = std::move(server_events);
    ASSERT_OK_AND_ASSIGN(listen_id, CreateCmId(server_events_.get()));
    listen_id_ = std::move(listen_id);
    sockaddr_in sin = Address(0);
    ASSERT_EQ(rdma_bind_addr(listen_id_.get(), Sockaddr(&sin)), 0)
        << VerbsError("rdma_bind_addr " + address_, errno);
    ASSERT_EQ(rdma_listen(listen_id_.get(), 4), 0)
        << VerbsError("rdma_listen", errno);
    port_ = ntohs(rdma_get_src_port(listen_id_.get()));

    // Client: resolve, set up its queue pair, connect with a greeting.
    ASSERT_OK_AND_ASSIGN(client_events, CreateEventChannel());
    client_events_ = std::move(client_events);
    ASSERT_OK_AND_ASSIGN(client_id, CreateCmId(client_events_.get()));
    client_.id = std::move(client_id);
    sockaddr_in dst = Address(port_);
    ASSERT_EQ(
        rdma_resolve_addr(client_.id.get(), nullptr, Sockaddr(&dst), 2000), 0);
    ASSERT_TRUE(
        WaitCmEvent(client_events_.get(), RDMA_CM_EVENT_ADDR_RESOLVED, kTimeout)
            .ok());
    ASSERT_EQ(rdma_resolve_route(client_.id.get(), 2000), 0);
    auto route = WaitCmEvent(client_events_.get(), RDMA_CM_EVENT_ROUTE_RESOLVED,
                             kTimeout);
    ASSERT_TRUE(route.ok()) << route.status();
    Status s = client_.Setup(kBufferBytes);
    ASSERT_TRUE(s.ok()) << s;
    rdma_conn_param param{};
    param.private_data = kHello;
    param.private_data_len = sizeof(kHello);
    param.responder_resources = 1;
    param.initiator_depth = 1;
    param.retry_count = 7;
    param.rnr_retry_count = 7;
    ASSERT_EQ(rdma_connect(client_.id.get(), &param), 0)
        << VerbsError("rdma_connect", errno);

    // Server: the request carries the greeting; accept it.
    auto request = WaitCmEvent(server_events_.get(),
                               RDMA_CM_EVENT_CONNECT_REQUEST, kTimeout);
    ASSERT_TRUE(request.ok()) << request.status();
    server_.id.reset(request->id);
    EXPECT_EQ(request->private_data.substr(0, sizeof(kHello) - 1),
              std::string(kHello));
    s = server_.Setup(kBufferBytes);
    ASSERT_TRUE(s.ok()) << s;
    rdma_conn_param accept{};
    accept.responder_resources = 1;
    accept.initiator_depth = 1;
    accept.rnr_retry_count = 7;
    ASSERT_EQ(rdma_accept(server_.id.get(), &accept), 0)
        << VerbsError("rdma_accept", errno);
    // The client's librdmacm moves its queue pair to RTS and answers the
    // server (RTU) while it handles the connect response: client first.
    auto established =
        WaitCmEvent(client_events_.get(), RDMA_CM_EVENT_ESTABLISHED, kTimeout);
    ASSERT_TRUE(established.ok()) << established.status();
    established =
        WaitCmEvent(server_events_.get(), RDMA_CM_EVENT_ESTABLISHED, kTimeout);
    ASSERT_TRUE(established.ok()) << established.status();
  }

  sockaddr_in Address(uint16_t port) const {
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_port = htons(port);
    inet_pton(AF_INET, address_.c_str(), &sin.sin_addr);
    return sin;
  }
  static sockaddr* Sockaddr(sockaddr_in* sin) {
    return reinterpret_cast<sockaddr*>(sin);
  }

  static void Fill(std::vector<uint8_t>& buf, size_t offset, size_t length,
                   uint8_t seed) {
    for (size_t i = 0; i < length; ++i) {
      buf[offset + i] = static_cast<uint8_t>(seed + i * 31 + (i >> 8));
    }
  }

  std::string address_;
  uint16_t port_ = 0;
  EventChannel server_events_;
  CmId listen_id_;
  EventChannel client_events_;
  Endpoint server_;
  Endpoint client_;
};

TEST_F(VerbsSelfTest, SendRecvByteExact) {
  for (size_t length :
       {size_t{1}, size_t{4096}, size_t{65536}, size_t{1} << 20}) {
    SCOPED_TRACE(length);
    std::fill(server_.buffer.begin(), server_.buffer.end(), 0);
    ASSERT_TRUE(server_.PostRecv(0, length, 7).ok());
    Fill(client_.buffer, 0, length, static_cast<uint8_t>(length));
    ASSERT_TRUE(client_.PostSend(0, length, 8).ok());

    auto sent = PollOne(client_.cq.get(), kTimeout);
    ASSERT_TRUE(sent.ok()) << sent.status();
    EXPECT_EQ(sent->opcode, IBV_WC_SEND);
    EXPECT_EQ(sent->wr_id, 8u);
    auto received = PollOne(server_.cq.get(), kTimeout);
    ASSERT_TRUE(received.ok()) << received.status();
    EXPECT_EQ(received->opcode, IBV_WC_RECV);
    EXPECT_EQ(received->wr_id, 7u);
    EXPECT_EQ(received->byte_len, length);
    EXPECT_EQ(std::memcmp(server_.buffer.data(), client_.buffer.data(), length),
              0);
  }
}

TEST_F(VerbsSelfTest, WriteWithImmediateByteExact) {
  // The server grants a window in the middle of its buffer, over SEND.
  constexpr size_t kOffset = 4096;
  constexpr size_t kLength = 8 << 20;
  constexpr uint32_t kImmediate = 0xC0FFEE42;
  ASSERT_TRUE(client_.PostRecv(0, sizeof(Grant), 1).ok());
  Grant grant{reinterpret_cast<uintptr_t>(server_.buffer.data() + kOffset),
              server_.mr->rkey, static_cast<uint32_t>(kLength)};
  std::memcpy(server_.buffer.data(), &grant, sizeof(grant));
  ASSERT_TRUE(server_.PostSend(0, sizeof(grant), 2).ok());
  ASSERT_TRUE(PollOne(server_.cq.get(), kTimeout).ok());
  auto got = PollOne(client_.cq.get(), kTimeout);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->byte_len, sizeof(Grant));
  Grant received_grant;
  std::memcpy(&received_grant, client_.buffer.data(), sizeof(received_grant));
  std::fill(server_.buffer.begin(), server_.buffer.end(), 0);

  // The write's immediate consumes a receive on the server.
  ASSERT_TRUE(server_.PostRecv(0, 0, 3).ok());
  Fill(client_.buffer, 0, kLength, 0x5a);
  ibv_sge sge{reinterpret_cast<uintptr_t>(client_.buffer.data()),
              static_cast<uint32_t>(kLength), client_.mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 4;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(kImmediate);
  wr.wr.rdma.remote_addr = received_grant.addr;
  wr.wr.rdma.rkey = received_grant.rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(client_.qp.get(), &wr, &bad), 0);

  auto written = PollOne(client_.cq.get(), kTimeout);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->opcode, IBV_WC_RDMA_WRITE);
  auto landed = PollOne(server_.cq.get(), kTimeout);
  ASSERT_TRUE(landed.ok()) << landed.status();
  EXPECT_EQ(landed->opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(landed->wr_id, 3u);
  ASSERT_TRUE(landed->wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(landed->imm_data), kImmediate);
  EXPECT_EQ(landed->byte_len, kLength);
  EXPECT_EQ(std::memcmp(server_.buffer.data() + kOffset, client_.buffer.data(),
                        kLength),
            0);
  // Nothing outside the granted window changed.
  auto zero = [](uint8_t b) { return b == 0; };
  EXPECT_TRUE(std::all_of(server_.buffer.begin(),
                          server_.buffer.begin() + kOffset, zero));
  EXPECT_TRUE(std::all_of(server_.buffer.begin() + kOffset + kLength,
                          server_.buffer.end(), zero));
}

TEST_F(VerbsSelfTest, WriteOutsideTheGrantFailsTheQueuePair) {
  // A remote write past the registered region must be refused by the
  // device, not land in memory: the writer sees a remote access error.
  ibv_sge sge{reinterpret_cast<uintptr_t>(client_.buffer.data()), 4096,
              client_.mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 9;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr =
      reinterpret_cast<uintptr_t>(server_.buffer.data()) + kBufferBytes - 100;
  wr.wr.rdma.rkey = server_.mr->rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(client_.qp.get(), &wr, &bad), 0);
  auto result = PollOne(client_.cq.get(), kTimeout);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("remote access error"),
            std::string::npos)
      << result.status();
}

// An id on a channel of its own, resolving port 1 of this host's RDMA
// address (nobody listens there); its ADDR_RESOLVED event follows.
class VerbsErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    auto addr = FindRdmaIpv4Address();
    ASSERT_TRUE(addr.ok()) << addr.status();
    auto events = CreateEventChannel();
    ASSERT_TRUE(events.ok()) << events.status();
    events_ = *std::move(events);
    auto id = CreateCmId(events_.get());
    ASSERT_TRUE(id.ok());
    id_ = *std::move(id);
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(1);
    inet_pton(AF_INET, addr->c_str(), &dst.sin_addr);
    ASSERT_EQ(rdma_resolve_addr(id_.get(), nullptr,
                                reinterpret_cast<sockaddr*>(&dst), 2000),
              0);
  }

  EventChannel events_;
  CmId id_;
};

TEST_F(VerbsErrors, ConnectWithNoListenerIsAnErrorNotAHang) {
  ASSERT_TRUE(
      WaitCmEvent(events_.get(), RDMA_CM_EVENT_ADDR_RESOLVED, kTimeout).ok());
  ASSERT_EQ(rdma_resolve_route(id_.get(), 2000), 0);
  ASSERT_TRUE(
      WaitCmEvent(events_.get(), RDMA_CM_EVENT_ROUTE_RESOLVED, kTimeout).ok());
  auto pd = AllocatePd(id_->verbs);
  ASSERT_TRUE(pd.ok());
  auto cq = CreateCq(id_->verbs, 4);
  ASSERT_TRUE(cq.ok());
  auto qp = CreateRcQp(id_.get(), pd->get(), cq->get(), {});
  ASSERT_TRUE(qp.ok()) << qp.status();
  rdma_conn_param param{};
  ASSERT_EQ(rdma_connect(id_.get(), &param), 0);
  auto event = WaitCmEvent(events_.get(), RDMA_CM_EVENT_ESTABLISHED, kTimeout);
  ASSERT_FALSE(event.ok());
  EXPECT_EQ(event.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(event.status().message().find("REJECTED"), std::string::npos)
      << event.status();
}

// An event that poll() reported goes with its id when the id is destroyed
// before the event is read. Reading the channel then must return at once:
// a blocking read waits in the kernel for the next event, out of reach of a
// stop request (a server's listener thread hung there in CI, and the
// server's shutdown with it).
TEST_F(VerbsErrors, AnEventGoneWithItsIdLeavesNoReadBlocked) {
  pollfd pfd{events_->fd, POLLIN, 0};
  ASSERT_EQ(poll(&pfd, 1, 10000), 1) << "no ADDR_RESOLVED event";
  id_.reset();  // its pending event goes with it
  auto read = std::make_shared<std::promise<int>>();
  auto result = read->get_future();
  rdma_event_channel* channel = events_.get();
  std::thread([read, channel] {
    rdma_cm_event* event = nullptr;
    errno = 0;
    int rc = rdma_get_cm_event(channel, &event);
    if (rc == 0) rdma_ack_cm_event(event);
    read->set_value(rc == 0 ? 0 : errno);
  }).detach();
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    (void)events_.release();  // the blocked thread still uses it
    FAIL() << "rdma_get_cm_event blocked with no event left on the channel";
  }
  EXPECT_EQ(result.get(), EAGAIN);
}

}  // namespace
}  // namespace rdmarpc::rdma
