// How one out-of-band part's bytes move by RDMA, by where they live. Each
// mover answers the same questions for its kind of memory: where the NIC
// reads a part being sent, how that memory is registered, where a part
// being received lands, how the landing memory is registered, and what
// must happen once the bytes landed before anyone reads them.
//
//   host         host memory: read and written where it is.
//   GPU direct   GPU memory the NIC reaches (dma-buf or peer-memory): read
//                and written where it is; flushed before the GPU reads it.
//   GPU staging  GPU memory the NIC cannot reach: sent from, and received
//                into, pinned host buffers copied to or from the GPU on its
//                copy streams (payload.cc orders those copies).
//
//   MoverChoice c = ChooseMover(tensor.device(), gpu);
//   RDMARPC_RETURN_IF_ERROR(c.mover->PrepareSource(tensor, &source, &keep));
//   RDMARPC_ASSIGN_OR_RETURN(LocalMemory mem,
//                            c.mover->RegisterSource(source, cache, pd));
//
// Movers are stateless singletons; every method is thread-safe.
#ifndef RDMARPC_TRANSPORT_RDMA_PAYLOAD_MOVER_H_
#define RDMARPC_TRANSPORT_RDMA_PAYLOAD_MOVER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

// Buffers an outgoing payload holds until its writes are done; a call's
// few tensors are held without an allocation.
using KeptBuffers = absl::InlinedVector<TensorBuffer, 2>;

class PayloadMover;

// What the payload code needs to reach GPU memory on one connection.
struct GpuAccess {
  ibv_pd* pd = nullptr;
  GpuRdmaMode requested = GpuRdmaMode::kAuto;
};

// An out-of-band part being sent: what the NIC reads, and how it got there.
struct PartSource {
  const void* data = nullptr;  // what the NIC reads
  uint64_t size = 0;
  const PayloadMover* mover = nullptr;
  // GPU staging: the GPU bytes copied into `data` once the grant is in.
  const void* staged_from = nullptr;
  int gpu = -1;
};

class PayloadMover {
 public:
  virtual ~PayloadMover() = default;

  // kStaging for host memory and GPU staging, else the GPU's direct mode.
  virtual GpuRdmaMode mode() const = 0;

  // Sending `buffer` out of band: sets where the NIC reads it. Memory that
  // must live as long as the call goes to `keep`.
  [[nodiscard]] virtual Status PrepareSource(const TensorBuffer& buffer,
                                             PartSource* source,
                                             KeptBuffers* keep) const = 0;
  // Its registration for local reads: host memory through `cache` (reused
  // across calls), GPU memory for this use only.
  [[nodiscard]] virtual StatusOr<LocalMemory> RegisterSource(
      const PartSource& source, RegistrationCache* cache, ibv_pd* pd) const = 0;

  // Receiving `size` bytes for `device`: where the peer writes them.
  // `supplied` (may be empty) is the caller's buffer for them. A staging
  // mover lands them in pinned memory and sets `staged_to` to where they go
  // afterwards (empty: a GPU buffer allocated then).
  [[nodiscard]] virtual StatusOr<TensorBuffer> AllocateLanding(
      Device device, uint64_t size, TensorBuffer supplied,
      TensorBuffer* staged_to) const = 0;
  // Whether its landing memory may be granted through a memory window
  // (registered with LandingAccess::kWindow).
  virtual bool LandsThroughWindows() const = 0;
  // Its registration for the grant's lifetime, for remote writes or for a
  // window bound over it.
  [[nodiscard]] virtual StatusOr<MemoryRegion> RegisterLanding(
      ibv_pd* pd, const TensorBuffer& landing, LandingAccess access) const = 0;
  // The bytes landed in `landing`: makes them visible to their reader.
  [[nodiscard]] virtual Status AfterLanded(
      const TensorBuffer& landing) const = 0;
};

struct MoverChoice {
  const PayloadMover* mover = nullptr;
  // For CallStats, GPU parts only (empty for host memory): the mode's name
  // and why it was chosen.
  std::string gpu_mode;
  std::string gpu_reason;
};

// The mover for memory on `device`. For a GPU: the best direct mode that
// works with `gpu.pd`'s device, or staging (with why) when none does.
MoverChoice ChooseMover(Device device, const GpuAccess& gpu);

// The GPU mover of `mode` (kAuto: staging), whether or not any device here
// could use it: for tests of what a mover does with memory alone.
const PayloadMover& GpuMoverForTesting(GpuRdmaMode mode);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_PAYLOAD_MOVER_H_
