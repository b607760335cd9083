// The end-to-end suite over the gRPC transport: forced, and chosen by the
// default 'auto' policy in a build without RDMA.
#include "e2e_fixture.h"

namespace rdmarpc_test {

INSTANTIATE_TEST_SUITE_P(
    Grpc, E2ETest,
    ::testing::Values(TransportCase{"grpc", rdmarpc::TransportPolicy::kGrpc,
                                    rdmarpc::TransportKind::kGrpc},
                      TransportCase{"auto", rdmarpc::TransportPolicy::kAuto,
                                    rdmarpc::TransportKind::kGrpc}),
    CaseName);

}  // namespace rdmarpc_test
