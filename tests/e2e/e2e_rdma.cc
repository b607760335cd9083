// The end-to-end suite over the RDMA transport: forced, and chosen by the
// default 'auto' policy. Needs an RDMA device (label rdma: the soft-RoCE VM
// harness provides one).
#include "e2e_fixture.h"

namespace rdmarpc_test {

INSTANTIATE_TEST_SUITE_P(
    Rdma, E2ETest,
    ::testing::Values(TransportCase{"rdma", rdmarpc::TransportPolicy::kRdma,
                                    rdmarpc::TransportKind::kRdma},
                      TransportCase{"auto", rdmarpc::TransportPolicy::kAuto,
                                    rdmarpc::TransportKind::kRdma}),
    CaseName);

}  // namespace rdmarpc_test
