// micro_bench: Google Benchmark cases for the per-call pieces under the
// transports.
//   BM_PlanSmallPart/T      planning a call's small part and encoding its
//                           frame (the message serialized into it; the
//                           bound tensor described, sent out of band);
//                           T times
//   BM_HostPoolAllocate/N   a MemoryPool buffer of N bytes, taken and freed
//   BM_MallocAllocate/N     TensorBuffer::Allocate of N bytes (the baseline)
//   BM_RegistrationHit/N    RegistrationCache::ForSend of a registered range
//   BM_RegistrationMiss/N   ForSend of memory not registered (ibv_reg_mr and
//                           ibv_dereg_mr per call)
// The registration cases need an RDMA device (bench/run_all.sh runs this in
// the soft-RoCE VM) and report an error without one.
#include <benchmark/benchmark.h>
#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <vector>

#include "e2e_test.pb.h"
#include "rdmarpc/rdmarpc.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"
#include "transport/rdma/wire.h"

namespace {

void BM_PlanSmallPart(benchmark::State& state) {
  const int tensors = static_cast<int>(state.range(0));
  std::vector<uint8_t> bytes(4096, 1);
  // One bound tensor per call: the echo request has a single tensor field,
  // so T > 1 repeats the planning T times.
  rdmarpc_test::EchoRequest req;
  req.set_note("a small note that travels with the call");
  rdmarpc::CallTensors bound;
  (void)bound.Set(req.mutable_tensor(), rdmarpc::DTYPE_U8, {4096},
                  rdmarpc::TensorBuffer::Borrow(bytes.data(), bytes.size()));
  std::vector<uint8_t> frame(32 << 10);
  for (auto _ : state) {
    for (int t = 0; t < tensors; ++t) {
      rdmarpc::rdma::RequestHead head;
      head.call_id = 1;
      head.method = "/rdmarpc_test.Echo/Echo";
      auto planned = rdmarpc::rdma::PlanPayload(req, bound, 32 << 10, 0, {},
                                                nullptr, &head.parts);
      if (!planned.ok()) {
        state.SkipWithError(std::string(planned.status().message()).c_str());
        return;
      }
      auto n = rdmarpc::rdma::EncodeFrame(rdmarpc::rdma::FrameType::kRequest, 0,
                                          &head, planned->inline_parts, frame,
                                          planned->message_part);
      benchmark::DoNotOptimize(n);
    }
  }
  state.SetItemsProcessed(state.iterations() * tensors);
}
BENCHMARK(BM_PlanSmallPart)->Arg(1)->Arg(8);

void BM_HostPoolAllocate(benchmark::State& state) {
  auto pool = rdmarpc::NewHostMemoryPool(size_t{256} << 20);
  for (auto _ : state) {
    auto b = pool->Allocate(static_cast<size_t>(state.range(0)));
    benchmark::DoNotOptimize(b);
  }
}
BENCHMARK(BM_HostPoolAllocate)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);

void BM_MallocAllocate(benchmark::State& state) {
  for (auto _ : state) {
    auto b =
        rdmarpc::TensorBuffer::Allocate(static_cast<size_t>(state.range(0)));
    benchmark::DoNotOptimize(b);
  }
}
BENCHMARK(BM_MallocAllocate)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);

// A protection domain on the first RDMA device, or null.
ibv_pd* FirstPd() {
  static ibv_pd* pd = []() -> ibv_pd* {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr || n == 0) return nullptr;
    ibv_context* ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    return ctx == nullptr ? nullptr : ibv_alloc_pd(ctx);
  }();
  return pd;
}

void Registration(benchmark::State& state, bool registered) {
  ibv_pd* pd = FirstPd();
  if (pd == nullptr) {
    state.SkipWithError("no RDMA device");
    return;
  }
  const size_t n = static_cast<size_t>(state.range(0));
  std::vector<uint8_t> memory(n, 1);
  if (registered) (void)rdmarpc::RegisterMemoryForRdma(memory.data(), n);
  auto cache = rdmarpc::rdma::RegistrationCache::Create(pd);
  for (auto _ : state) {
    auto mem = cache->ForSend(memory.data(), n);
    if (!mem.ok()) {
      state.SkipWithError(std::string(mem.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(mem);
  }
  cache->Clear();
  if (registered) (void)rdmarpc::UnregisterMemoryForRdma(memory.data());
}

void BM_RegistrationHit(benchmark::State& state) { Registration(state, true); }
void BM_RegistrationMiss(benchmark::State& state) {
  Registration(state, false);
}
BENCHMARK(BM_RegistrationHit)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);
BENCHMARK(BM_RegistrationMiss)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);

}  // namespace

BENCHMARK_MAIN();
