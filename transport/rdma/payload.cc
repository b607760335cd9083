#include "transport/rdma/payload.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"
#include "runtime/tensor_walk.h"
#include "runtime/thread_pool.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/registration.h"

namespace rdmarpc::rdma {
namespace {

// Staging copies and their writes go in chunks of this size, so that the
// copy of one chunk overlaps the write of the one before.
constexpr size_t kStagingChunk = size_t{4} << 20;

std::span<const uint8_t> Bytes(const void* data, size_t size) {
  return {static_cast<const uint8_t*>(data), size};
}

}  // namespace

StatusOr<OutgoingPayload> PlanPayload(const google::protobuf::Message& msg,
                                      const CallTensors& tensors,
                                      size_t frame_room,
                                      uint64_t inline_threshold,
                                      const GpuAccess& gpu, void* cuda_stream,
                                      Parts* parts) {
  RDMARPC_ASSIGN_OR_RETURN(internal::OutgoingPlan plan,
                           internal::PlanOutgoing(msg, tensors));
  OutgoingPayload out;
  // Its one size computation: the frame serializes it with cached sizes.
  const size_t message_bytes = msg.ByteSizeLong();
  if (message_bytes > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message of ", message_bytes,
        " bytes cannot be serialized (over protobuf's 2 GiB limit without "
        "its tensors?)"));
  }
  out.tensor_bytes = plan.total_bytes;
  size_t head_reserve = (plan.tensors.size() + 1) * kPartBytes;
  size_t room = frame_room > head_reserve ? frame_room - head_reserve : 0;
  // Spans point into the staged copies: no reallocation may move them.
  size_t gpu_tensors = 0;
  for (const internal::OutgoingTensor& t : plan.tensors) {
    gpu_tensors += t.out_of_band && t.buffer.device().is_cuda();
  }
  out.staged.reserve(gpu_tensors);
  parts->reserve(plan.tensors.size() + 1);
  auto add = [&](PartSource source, bool may_inline, bool in_message) {
    Part& part = parts->emplace_back();
    part.size = source.size;
    if (in_message) {
      part.in_message = true;
    } else if (may_inline && source.size <= room) {
      room -= source.size;
      out.inline_parts.push_back(Bytes(source.data, source.size));
    } else {
      part.out_of_band = true;
      out.out_of_band.push_back(source);
    }
  };
  // The producer's work on `cuda_stream`, recorded once for every GPU part.
  auto fence_for = [&](int index) -> Status {
    if (out.fence != nullptr) return absl::OkStatus();
    RDMARPC_ASSIGN_OR_RETURN(out.fence,
                             internal::CudaRecordFence(index, cuda_stream));
    out.fence_gpu = index;
    return absl::OkStatus();
  };
  const MoverChoice host = ChooseMover(Device::Host(), gpu);
  if (message_bytes <= room) {
    // Part 0 in the frame, serialized there (no copy of it here).
    room -= message_bytes;
    parts->emplace_back().size = message_bytes;
    out.message_part = {&msg, message_bytes};
  } else {
    out.message = std::make_unique<std::string>();
    out.message->resize(message_bytes);
    msg.SerializeWithCachedSizesToArray(
        reinterpret_cast<uint8_t*>(out.message->data()));
    add({out.message->data(), out.message->size(), host.mover}, false, false);
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const internal::OutgoingTensor& t = plan.tensors[i];
    if (!t.out_of_band) {
      add({nullptr, t.size, host.mover}, false, true);
      continue;
    }
    bool may_inline = t.size <= inline_threshold && t.size <= room;
    PartSource source{t.buffer.data(), t.size, host.mover};
    const Device device = t.buffer.device();
    if (device.is_cuda() && may_inline) {
      // Into the frame: copied out now, after the producer's work.
      std::string& copy = out.staged.emplace_back(t.size, '\0');
      RDMARPC_RETURN_IF_ERROR(fence_for(device.index));
      RDMARPC_RETURN_IF_ERROR(out.fence->Wait());
      RDMARPC_RETURN_IF_ERROR(CopyBytes(copy.data(), Device::Host(),
                                        t.buffer.data(), device, t.size));
      source.data = copy.data();
    } else if (device.is_cuda()) {
      RDMARPC_RETURN_IF_ERROR(fence_for(device.index));
      MoverChoice c = ChooseMover(device, gpu);
      source.mover = c.mover;
      RDMARPC_RETURN_IF_ERROR(
          c.mover->PrepareSource(t.buffer, &source, &out.keep));
      out.gpu_mode = std::move(c.gpu_mode);
      out.gpu_reason = std::move(c.gpu_reason);
    }
    add(source, may_inline, false);
    if (may_inline) out.cpu_copied_bytes += t.size;
    out.keep.push_back(t.buffer);
  }
  return out;
}

StatusOr<std::vector<LocalMemory>> RegisterSources(const OutgoingPayload& out,
                                                   RegistrationCache* cache,
                                                   ibv_pd* pd) {
  std::vector<LocalMemory> sources;
  sources.reserve(out.out_of_band.size());
  for (const PartSource& src : out.out_of_band) {
    RDMARPC_ASSIGN_OR_RETURN(LocalMemory mem,
                             src.mover->RegisterSource(src, cache, pd));
    sources.push_back(std::move(mem));
  }
  return sources;
}

StatusOr<uint64_t> GrantCallId(const FrameView& frame) {
  Grant probe;
  if (!probe.ParseFromArray(frame.head.data(),
                            static_cast<int>(frame.head.size()))) {
    return absl::InvalidArgumentError("grant head does not parse");
  }
  return probe.call_id();
}

namespace {

// Failed posts from CUDA's host-function thread report on this thread: a
// `done` may run user callbacks, which must not run where CUDA forbids
// CUDA calls.
internal::ThreadPool& PostFailures() {
  static auto* pool = new internal::ThreadPool(1, "rdmarpc-gpufail");
  return *pool;
}

// The write of out-of-band part `k` into its granted region (no immediate).
Connection::WriteRequest PartWrite(const Grant& grant, int k,
                                   const OutgoingPayload& out,
                                   std::span<const LocalMemory> sources) {
  Connection::WriteRequest w;
  w.local = out.out_of_band[k].data;
  w.lkey = sources[k].lkey;
  w.remote_addr = grant.regions(k).addr();
  w.rkey = grant.regions(k).rkey();
  w.length = grant.regions(k).length();
  return w;
}

// The buffers a grant's GPU-ordered writes read, held by every queued
// host function so that a call finished early (its connection closed) does
// not hand them back while a copy or write still uses them. The last holder
// may be a host function: the release (a cudaFree, for one) then runs on a
// runtime thread.
std::shared_ptr<std::vector<TensorBuffer>> HoldForWrites(
    const KeptBuffers& keep) {
  return std::shared_ptr<std::vector<TensorBuffer>>(
      new std::vector<TensorBuffer>(keep.begin(), keep.end()),
      [](std::vector<TensorBuffer>* v) {
        PostFailures().Post([v] { delete v; });
      });
}

// Posts the writes of a grant with GPU parts in stream order on the send
// copy stream: after the producer's fence, each staged part chunk by chunk
// as its copy lands, the others as they come. Returns the number of writes
// queued; if queueing fails part-way, the connection is closed and the
// writes already queued report through `done` when they fail to post.
int WriteGpuOrdered(const Grant& grant, const OutgoingPayload& out,
                    std::span<const LocalMemory> sources,
                    const std::shared_ptr<Connection>& conn,
                    const std::function<void(Status)>& done,
                    const std::function<void()>& moved) {
  auto held = HoldForWrites(out.keep);
  auto post = [conn, done, held](Connection::WriteRequest w) {
    Status posted = conn->Write(w, done);
    if (!posted.ok()) PostFailures().Post([done, posted] { done(posted); });
  };
  const int gpu = out.fence_gpu;
  int counted = 0;
  for (int k = 0; k < grant.regions_size(); ++k) {
    const PartSource& src = out.out_of_band[k];
    Connection::WriteRequest w = PartWrite(grant, k, out, sources);
    w.on_piece = moved;
    const bool last_part = k + 1 == grant.regions_size();
    Status queued;
    if (src.staged_from == nullptr || src.size == 0) {
      if (last_part) w.immediate = grant.grant_id();
      queued = internal::CudaThen(gpu, out.fence.get(), [post, w] { post(w); });
      if (queued.ok()) ++counted;
    } else {
      const uint32_t grant_id = grant.grant_id();
      int chunks = 0;
      queued = internal::CudaCopyInChunks(
          gpu, out.fence.get(), const_cast<void*>(src.data), src.staged_from,
          src.size, kStagingChunk,
          [post, w, last_part, grant_id](size_t offset, size_t length) {
            Connection::WriteRequest piece = w;
            piece.local = static_cast<const char*>(w.local) + offset;
            piece.remote_addr = w.remote_addr + offset;
            piece.length = length;
            if (last_part && offset + length == w.length) {
              piece.immediate = grant_id;
            }
            post(piece);
          },
          &chunks);
      counted += chunks;
    }
    if (!queued.ok()) {
      conn->Close(
          absl::InternalError(absl::StrCat(
              "queueing a GPU part's writes failed: ", queued.message())),
          "CUDA error");
      break;
    }
  }
  return counted;
}

}  // namespace

StatusOr<int> WriteGrantedParts(const FrameView& frame,
                                const OutgoingPayload& out,
                                std::span<const LocalMemory> sources,
                                const std::shared_ptr<Connection>& conn,
                                const std::function<void(Status)>& done,
                                const std::function<void()>& moved) {
  RDMARPC_ASSIGN_OR_RETURN(Grant grant,
                           ParseGrant(frame, out.out_of_band.size()));
  for (int k = 0; k < grant.regions_size(); ++k) {
    if (grant.regions(k).length() != out.out_of_band[k].size) {
      return absl::InvalidArgumentError(
          absl::StrCat("grant region ", k, " holds ", grant.regions(k).length(),
                       " bytes for a part of ", out.out_of_band[k].size));
    }
  }
  if (out.fence != nullptr) {
    return WriteGpuOrdered(grant, out, sources, conn, done, moved);
  }
  int queued = 0;
  for (int k = 0; k < grant.regions_size(); ++k) {
    Connection::WriteRequest w = PartWrite(grant, k, out, sources);
    w.on_piece = moved;
    if (k + 1 == grant.regions_size()) w.immediate = grant.grant_id();
    if (!conn->Write(w, done).ok()) break;  // closed: the endpoint fails it
    ++queued;
  }
  return queued;
}

Status ReceivePayload(const Parts& parts, std::string_view inline_bytes,
                      uint64_t max_tensor_bytes,
                      std::span<const TensorBuffer> supplied,
                      const internal::TensorPlacement& placement,
                      const google::protobuf::Message* prototype,
                      const GpuAccess& gpu, IncomingPayload* out) {
  IncomingPayload& in = *out;
  in.parts = parts;
  in.inline_tensors.resize(parts.size() - 1);
  uint64_t tensor_total = 0;
  size_t offset = 0;
  const bool all_in_frame = std::none_of(
      parts.begin(), parts.end(), [](const Part& p) { return p.out_of_band; });
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const Part& p = in.parts[i];
    if (i == 0 && p.size > INT_MAX) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "message part of ", p.size, " bytes exceeds protobuf's 2 GiB limit"));
    }
    if (i > 0) {
      if (p.size > max_tensor_bytes - tensor_total) {
        return absl::ResourceExhaustedError(
            absl::StrCat("message tensors exceed the receiver's limit of ",
                         max_tensor_bytes, " bytes"));
      }
      tensor_total += p.size;
    }
    if (p.in_message) continue;
    if (!p.out_of_band) {
      std::string_view bytes = inline_bytes.substr(offset, p.size);
      offset += p.size;
      if (i == 0 && all_in_frame) {
        in.message_in_frame = bytes;
      } else if (i == 0) {
        in.message.assign(bytes);
      } else {
        in.inline_tensors[i - 1].assign(bytes);
      }
    }
  }
  // Nothing to land: a small call's parts all came in the frame.
  if (all_in_frame) return absl::OkStatus();
  // Where each tensor goes: per field needs the message, which is known
  // here only when it came in the frame; otherwise FinishPayload moves the
  // tensors of fields placed apart.
  absl::InlinedVector<Device, 2> devices(in.parts.size() - 1, placement.device);
  if (!placement.by_field.empty() && prototype != nullptr &&
      !in.parts[0].out_of_band) {
    std::unique_ptr<google::protobuf::Message> probe(prototype->New());
    // Some part is out of band, so the message was copied out of the frame.
    if (probe->ParseFromArray(in.message.data(),
                              static_cast<int>(in.message.size()))) {
      auto resolved = placement.Resolve(*probe);
      if (resolved.ok() && resolved->size() == devices.size()) {
        devices.assign(resolved->begin(), resolved->end());
      }
    }
  }
  // Landings in host memory share one block (of the landing arena where
  // it has room), granted through one memory window (GrantThroughWindow,
  // RegisterLandingMemory).
  auto lands_in_block = [&](size_t i) {
    return in.parts[i].out_of_band &&
           (i == 0 || (devices[i - 1].is_host() &&
                       (i - 1 >= supplied.size() || supplied[i - 1].empty())));
  };
  size_t block_bytes = 0;
  for (size_t i = 0; i < in.parts.size(); ++i) {
    if (!in.parts[i].out_of_band) continue;
    if (!lands_in_block(i)) continue;
    const size_t rounded = LandingArena::Rounded(in.parts[i].size);
    if (rounded < in.parts[i].size || block_bytes + rounded < block_bytes) {
      return absl::ResourceExhaustedError(
          "the announced tensor sizes overflow the landing memory's size");
    }
    block_bytes += rounded;
  }
  LandingArena* arena = LandingArena::Get();
  if (block_bytes > 0) {
    std::optional<TensorBuffer> block;
    if (arena != nullptr) block = arena->Allocate(block_bytes);
    if (block.has_value()) {
      in.landing_block = *std::move(block);
    } else {
      // The arena is off or full: the landings share a block of the
      // call's own all the same, granted through one window over one
      // registration (not one each: a connection has 32 windows).
      TensorBuffer unused;
      RDMARPC_ASSIGN_OR_RETURN(
          in.landing_block, ChooseMover(Device::Host(), gpu)
                                .mover->AllocateLanding(
                                    Device::Host(), block_bytes, {}, &unused));
    }
  }
  size_t block_offset = 0;
  for (size_t i = 0; i < in.parts.size(); ++i) {
    const Part& p = in.parts[i];
    if (!p.out_of_band) continue;
    if (!in.landing_block.empty() && lands_in_block(i)) {
      in.landing.push_back(in.landing_block.Slice(block_offset, p.size));
      block_offset += LandingArena::Rounded(p.size);
      in.landing_part.push_back(i);
      in.landing_movers.push_back(ChooseMover(Device::Host(), gpu).mover);
      in.staged_to.emplace_back();
      in.staged_device.push_back(Device::Host());
      continue;
    }
    TensorBuffer supplied_buffer;
    Device device = i == 0 ? Device::Host() : devices[i - 1];
    if (i > 0 && i - 1 < supplied.size() && !supplied[i - 1].empty()) {
      const TensorBuffer& s = supplied[i - 1];
      if (s.size() < p.size) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "response tensor #", i - 1, " is ", p.size,
            " bytes; the buffer given with SetResponseTensorBuffer holds ",
            s.size()));
      }
      supplied_buffer = s.Slice(0, p.size);
      device = s.device();
    }
    MoverChoice c = ChooseMover(device, gpu);
    if (device.is_cuda()) {
      in.gpu_mode = std::move(c.gpu_mode);
      in.gpu_reason = std::move(c.gpu_reason);
    }
    TensorBuffer staged_to;
    RDMARPC_ASSIGN_OR_RETURN(
        TensorBuffer landing,
        c.mover->AllocateLanding(device, p.size, std::move(supplied_buffer),
                                 &staged_to));
    const bool staged =
        device.is_cuda() && c.mover->mode() == GpuRdmaMode::kStaging;
    in.landing.push_back(std::move(landing));
    in.landing_part.push_back(i);
    in.landing_movers.push_back(c.mover);
    in.staged_to.push_back(std::move(staged_to));
    in.staged_device.push_back(staged ? device : Device::Host());
  }
  return absl::OkStatus();
}

namespace {

bool InBlock(const TensorBuffer& block, const TensorBuffer& part) {
  const auto* begin = static_cast<const char*>(block.data());
  const auto* at = static_cast<const char*>(part.data());
  return !block.empty() && at >= begin && at < begin + block.size();
}

bool InArena(const TensorBuffer& block) {
  LandingArena* arena = LandingArena::Get();
  return arena != nullptr && arena->SegmentOf(block.data()) >= 0;
}

}  // namespace

bool ReserveLandingWindows(IncomingPayload* in, Connection* conn,
                           absl::FunctionRef<Connection::WindowsReady()> wait) {
  // One for the block, one for each other landing that takes one.
  uint32_t count = 0;
  bool in_block = false;
  for (size_t k = 0; k < in->landing.size(); ++k) {
    if (InBlock(in->landing_block, in->landing[k])) {
      in_block = true;
    } else if (in->landing_movers[k]->LandsThroughWindows()) {
      ++count;
    }
  }
  if (in_block) ++count;
  if (count == 0) return true;
  return conn->ReserveWindows(count, &in->windows, wait);
}

bool GrantThroughWindow(IncomingPayload* in, Connection* conn) {
  if (in->landing_block.empty() || in->windows.empty() || in->windows.front() ||
      !InArena(in->landing_block)) {
    return false;
  }
  for (const TensorBuffer& landing : in->landing) {
    if (!InBlock(in->landing_block, landing)) return false;
  }
  return conn->BindArenaWindow(in->windows.front(), in->landing_block).ok();
}

namespace {

// Binds `window` over `block` (the call's landing block): through the
// arena's registration on `conn` where it has one, else through one made
// for this grant. Counts that registration in in->registrations.
Status BindBlockWindow(IncomingPayload* in, Connection* conn,
                       Connection::WindowGrant& window) {
  if (window) return absl::OkStatus();  // GrantThroughWindow bound it
  const TensorBuffer& block = in->landing_block;
  if (InArena(block)) {
    // Closing (or closed by a failed post): no registration is worth
    // making then.
    Status bound = conn->BindArenaWindow(window, block);
    if (bound.ok() || conn->closed()) return bound;
  }
  RDMARPC_ASSIGN_OR_RETURN(
      MemoryRegion mr, RegisterLanding(conn->pd(), block.data(), block.size(),
                                       LandingAccess::kWindow));
  ++in->registrations;
  return window.Bind(block, std::move(mr));
}

}  // namespace

Status RegisterLandingMemory(IncomingPayload* in, Connection* conn) {
  // The reserved windows are bound in order, the landing block's first.
  const bool block_windowed =
      !in->landing_block.empty() && !in->windows.empty() &&
      std::any_of(in->landing.begin(), in->landing.end(),
                  [&](const TensorBuffer& landing) {
                    return InBlock(in->landing_block, landing);
                  });
  if (block_windowed) {
    RDMARPC_RETURN_IF_ERROR(BindBlockWindow(in, conn, in->windows.front()));
  }
  size_t next_window = block_windowed ? 1 : 0;
  for (size_t k = 0; k < in->landing.size(); ++k) {
    const TensorBuffer& landing = in->landing[k];
    const PayloadMover* mover = in->landing_movers[k];
    if (block_windowed && InBlock(in->landing_block, landing)) {
      in->landing_mrs.emplace_back();
      in->landing_rkeys.push_back(in->windows.front().rkey());
      continue;
    }
    if (mover->LandsThroughWindows() && next_window < in->windows.size()) {
      Connection::WindowGrant& window = in->windows[next_window++];
      RDMARPC_ASSIGN_OR_RETURN(
          MemoryRegion mr,
          mover->RegisterLanding(conn->pd(), landing, LandingAccess::kWindow));
      // Fault injection: the connection starts closing meanwhile (a
      // registration aside takes long), so the bind fails.
      if (RDMARPC_FAULT("rdma.close_before_window_bind")) {
        conn->Close(absl::UnavailableError("fault: closed before a bind"),
                    "fault");
      }
      ++in->registrations;
      RDMARPC_RETURN_IF_ERROR(window.Bind(landing, std::move(mr)));
      in->landing_mrs.emplace_back();
      in->landing_rkeys.push_back(window.rkey());
      continue;
    }
    // No window for it: none on the device, a GPU's memory, or more
    // landings than the connection has windows. Registered for remote
    // write, which only a domain of the connection's own keeps to it.
    if (conn->shares_domain()) {
      const Status windows = conn->WindowsUnavailable();
      return absl::ResourceExhaustedError(absl::StrCat(
          "the call's landings need more memory windows than its RDMA "
          "connection can give (",
          windows.ok() ? absl::StrCat(conn->landing_windows(),
                                      " at once: one for the call's host "
                                      "tensors, one for each other landing, "
                                      "such as a buffer given with "
                                      "SetResponseTensorBuffer")
                       : windows.message(),
          "), and the connection shares its protection domain with "
          "others, so landing memory is not registered for remote write"));
    }
    RDMARPC_ASSIGN_OR_RETURN(
        MemoryRegion mr, mover->RegisterLanding(conn->pd(), landing,
                                                LandingAccess::kRemoteWrite));
    ++in->registrations;
    in->landing_rkeys.push_back(mr->rkey);
    in->landing_mrs.push_back(std::move(mr));
  }
  return absl::OkStatus();
}

bool EndLandingWindows(IncomingPayload* in, std::function<void(Status)> done) {
  if (in->windows.size() == 1) {
    const bool ending = in->windows.front().End(std::move(done));
    in->windows.clear();
    return ending;
  }
  if (in->windows.empty()) return false;
  // The last to end runs `done`; the count holds one more for this loop,
  // so that `done` runs only if one of them is still ending after it.
  struct Ending {
    std::atomic<size_t> left;
    std::function<void(Status)> done;
  };
  auto ending = std::make_shared<Ending>();
  ending->left.store(in->windows.size() + 1);
  ending->done = std::move(done);
  auto one_ended = [ending](Status) {
    if (ending->left.fetch_sub(1) == 1) ending->done(absl::OkStatus());
  };
  for (Connection::WindowGrant& window : in->windows) {
    if (!window.End(one_ended)) ending->left.fetch_sub(1);
  }
  in->windows.clear();
  return ending->left.fetch_sub(1) != 1;
}

bool HoldsLandingRegions(const IncomingPayload& in) {
  return std::any_of(in.landing_mrs.begin(), in.landing_mrs.end(),
                     [](const MemoryRegion& mr) { return mr != nullptr; });
}

void AddGrantRegions(const IncomingPayload& in, Grant* grant) {
  for (size_t k = 0; k < in.landing.size(); ++k) {
    Region* r = grant->add_regions();
    r->set_addr(reinterpret_cast<uintptr_t>(in.landing[k].data()));
    r->set_rkey(in.landing_rkeys[k]);
    r->set_length(in.landing[k].size());
  }
}

Status CheckGrantFits(size_t regions, size_t receive_bytes, const char* what) {
  // Varints at their widest: call id and grant id, then per region its
  // tag and length, addr, rkey and length fields.
  constexpr size_t kGrantBytes = 2 * (1 + 10);
  constexpr size_t kRegionBytes = 2 + (1 + 10) + (1 + 5) + (1 + 10);
  size_t frame = FrameBytes(kGrantBytes + regions * kRegionBytes, 0);
  if (frame <= receive_bytes) return absl::OkStatus();
  size_t most = (receive_bytes - FrameBytes(kGrantBytes, 0)) / kRegionBytes;
  return absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", regions,
                   " RDMA writes (one per part sent out of band); one call "
                   "can grant at most ",
                   most, " (a grant must fit one ", receive_bytes,
                   "-byte RDMA receive buffer): send fewer, larger tensors"));
}

StatusOr<internal::IncomingResult> FinishPayload(
    IncomingPayload* in, google::protobuf::Message* msg,
    const internal::TensorPlacement& placement, uint64_t max_tensor_bytes,
    std::shared_ptr<const void> owner, CallTensors* tensors,
    const internal::ConsumerStream* consumer) {
  // The grant ends here: the peer can no longer write into this memory.
  // A window is ended before (it takes a completion), by the endpoint.
  if (!in->windows.empty()) {
    return absl::InternalError("landed bytes read while their window is open");
  }
  in->landing_mrs.clear();
  // Staged parts: their GPU destination is bound now and filled last, once
  // every check has passed, so that no copy is in flight on an error.
  struct Staged {
    TensorBuffer pinned, dst;
    Device to;
  };
  std::vector<Staged> staged;
  for (size_t k = 0; k < in->landing.size(); ++k) {
    RDMARPC_RETURN_IF_ERROR(in->landing_movers[k]->AfterLanded(in->landing[k]));
    const Device to = in->staged_device[k];
    if (!to.is_cuda()) continue;
    TensorBuffer dst = std::move(in->staged_to[k]);
    if (dst.empty()) {
      RDMARPC_ASSIGN_OR_RETURN(
          dst, internal::AllocateGpuLanding(to.index, in->landing[k].size()));
    }
    staged.push_back({std::move(in->landing[k]), dst, to});
    in->landing[k] = std::move(dst);
  }
  auto copy_staged = [&](const internal::ConsumerStream* to_stream) -> Status {
    for (Staged& st : staged) {
      RDMARPC_RETURN_IF_ERROR(internal::CudaCopyOrdered(
          st.dst.data(), st.to, st.pinned.data(), Device::Host(),
          st.pinned.size(), to_stream, st.pinned));
    }
    return absl::OkStatus();
  };
  // A field placed apart from where its bytes landed is moved by
  // AcceptIncoming, which must then read the copied bytes.
  const bool fill_first = !placement.by_field.empty();
  if (fill_first) RDMARPC_RETURN_IF_ERROR(copy_staged(nullptr));
  absl::InlinedVector<TensorBuffer, 2> landed(in->parts.size());
  for (size_t k = 0; k < in->landing.size(); ++k) {
    landed[in->landing_part[k]] = in->landing[k];
  }
  std::string_view message = in->message;
  if (!landed[0].empty()) {
    message = {static_cast<const char*>(landed[0].data()), landed[0].size()};
  } else if (in->message_in_frame.data() != nullptr) {
    message = in->message_in_frame;
  }
  bool parsed =
      msg->ParseFromArray(message.data(), static_cast<int>(message.size()));
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("message does not parse as ", msg->GetTypeName()));
  }
  internal::WalkedTensors walked;
  RDMARPC_RETURN_IF_ERROR(internal::WalkForPlacement(msg, placement, &walked));
  const internal::MutableTensorList& fields = walked.fields;
  if (fields.size() + 1 != in->parts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer announced ", in->parts.size() - 1,
                     " tensors but the message holds ", fields.size()));
  }
  absl::InlinedVector<internal::IncomingPart, 1> parts;
  parts.reserve(fields.size());
  uint64_t copied = 0;
  for (size_t i = 0; i < fields.size(); ++i) {
    const Part& p = in->parts[i + 1];
    if (!p.out_of_band && !p.in_message) {
      if (!fields[i]->data().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor #", i, ": sent in the frame and inside the message"));
      }
      fields[i]->set_data(std::move(in->inline_tensors[i]));
      copied += p.size;
    }
    parts.push_back({p.out_of_band, p.size, landed[i + 1]});
  }
  RDMARPC_ASSIGN_OR_RETURN(
      internal::IncomingResult result,
      internal::AcceptIncoming(msg, walked, parts, placement, max_tensor_bytes,
                               std::move(owner), tensors));
  if (!fill_first) RDMARPC_RETURN_IF_ERROR(copy_staged(consumer));
  for (const Staged& st : staged) result.cpu_copied_bytes += st.pinned.size();
  result.cpu_copied_bytes += copied;
  return result;
}

}  // namespace rdmarpc::rdma
