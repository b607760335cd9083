// The runtime's way into the internals of public classes, so that their
// public API carries no methods meant only for the runtime (gRPC's
// accessor-class idea). Transports and the core use these; users cannot
// reach them (not installed).
//
//   CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
#ifndef RDMARPC_RUNTIME_ACCESS_H_
#define RDMARPC_RUNTIME_ACCESS_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "rdmarpc/client_context.h"
#include "rdmarpc/tensor.h"

namespace rdmarpc::internal {

class ClientContextAccess {
 public:
  static CallStats* mutable_stats(ClientContext* ctx) { return &ctx->stats_; }
  // Attaches the transport's canceller for the call `call_id` (what
  // TryCancel passes to Cancel); false (and not attached) if TryCancel()
  // already ran.
  static bool AttachCanceller(ClientContext* ctx,
                              std::shared_ptr<CallCanceller> canceller,
                              uint64_t call_id) {
    return ctx->AttachCanceller(std::move(canceller), call_id);
  }
  static void DetachCanceller(ClientContext* ctx) { ctx->DetachCanceller(); }
  // What the server sent with the response; replaces what an earlier
  // transport's attempt at the call left.
  static void SetServerMetadata(
      ClientContext* ctx, std::multimap<std::string, std::string> initial,
      std::multimap<std::string, std::string> trailing) {
    ctx->server_initial_metadata_ = std::move(initial);
    ctx->server_trailing_metadata_ = std::move(trailing);
  }
  // Marks the context used; false if it was used before.
  static bool MarkStarted(ClientContext* ctx) {
    return !ctx->started_.exchange(true);
  }
};

class CallTensorsAccess {
 public:
  // The buffer bound to `field`, or nullptr.
  static const TensorBuffer* Find(const CallTensors& tensors,
                                  const Tensor& field) {
    return tensors.Find(field);
  }
  // Records received bytes for `field`.
  static void Bind(CallTensors* tensors, const Tensor& field,
                   TensorBuffer buffer) {
    tensors->Bind(field, std::move(buffer));
  }
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_ACCESS_H_
