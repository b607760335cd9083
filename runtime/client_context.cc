#include "rdmarpc/client_context.h"

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
  std::shared_ptr<internal::CallCanceller> canceller;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_.store(true);
    canceller = canceller_;
  }
  if (canceller) canceller->Cancel();
}

bool ClientContext::AttachCanceller(
    std::shared_ptr<internal::CallCanceller> canceller) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.load()) return false;
  canceller_ = std::move(canceller);
  return true;
}

void ClientContext::DetachCanceller() {
  std::lock_guard<std::mutex> lock(mu_);
  canceller_.reset();
}

}  // namespace rdmarpc
