#include "rdmarpc/client_context.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace rdmarpc {

const char* TransportName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kNone:
      return "none";
    case TransportKind::kGrpc:
      return "grpc";
    case TransportKind::kRdma:
      return "rdma";
  }
  return "unknown";
}

std::string CallStats::ToString() const {
  return absl::StrCat("transport=", TransportName(transport), " (",
                      transport_reason, ") call_id=", call_id,
                      " tensor_bytes_sent=", tensor_bytes_sent,
                      " tensor_bytes_received=", tensor_bytes_received,
                      " cpu_copied_bytes=", cpu_copied_bytes,
                      gpu_rdma_mode.empty() ? "" : " gpu_rdma=", gpu_rdma_mode,
                      gpu_rdma_reason.empty() ? "" : " (", gpu_rdma_reason,
                      gpu_rdma_reason.empty() ? "" : ")");
}

void ClientContext::TryCancel() {
  cancelled_.store(true);
  // Marked cancelled and counted as a reader in one step: a canceller
  // attached before it is read here, one attached after is refused.
  uint32_t before = canceller_state_.load();
  while (!canceller_state_.compare_exchange_weak(
      before, (before | kCancelled) + kReader)) {
  }
  std::shared_ptr<internal::CallCanceller> canceller;
  uint64_t call_id = 0;
  if ((before & kAttached) != 0 && (before & kCancelled) == 0) {
    canceller = canceller_;
    call_id = canceller_call_id_;
  }
  canceller_state_.fetch_sub(kReader);
  if (canceller) canceller->Cancel(call_id);
}

void ClientContext::UnpublishCanceller() {
  canceller_state_.fetch_and(~kAttached);
  // A reader holds on only while it copies the pointer.
  while (canceller_state_.load() >= kReader) std::this_thread::yield();
}

bool ClientContext::AttachCanceller(
    std::shared_ptr<internal::CallCanceller> canceller, uint64_t call_id) {
  UnpublishCanceller();  // a call re-sent may attach again
  canceller_ = std::move(canceller);
  canceller_call_id_ = call_id;
  if ((canceller_state_.fetch_or(kAttached) & kCancelled) != 0) {
    // Cancelled before: no TryCancel reads it from now on.
    canceller_state_.fetch_and(~kAttached);
    canceller_.reset();
    return false;
  }
  return true;
}

void ClientContext::DetachCanceller() {
  UnpublishCanceller();
  canceller_.reset();
}

}  // namespace rdmarpc
