#include "rdmarpc/channel_options.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc {

const char* PolicyName(TransportPolicy policy) {
  switch (policy) {
    case TransportPolicy::kAuto:
      return "auto";
    case TransportPolicy::kRdma:
      return "rdma";
    case TransportPolicy::kGrpc:
      return "grpc";
  }
  return "unknown";
}

StatusOr<TransportPolicy> ParsePolicy(std::string_view name) {
  if (name == "auto") return TransportPolicy::kAuto;
  if (name == "rdma") return TransportPolicy::kRdma;
  if (name == "grpc") return TransportPolicy::kGrpc;
  return absl::InvalidArgumentError(absl::StrCat("unknown transport policy '",
                                                 std::string(name),
                                                 "' (use auto, rdma or grpc)"));
}

const char* RdmaHealthName(RdmaHealth health) {
  switch (health) {
    case RdmaHealth::kNotTried:
      return "not-tried";
    case RdmaHealth::kConnecting:
      return "connecting";
    case RdmaHealth::kReady:
      return "rdma-ready";
    case RdmaHealth::kDegraded:
      return "degraded";
    case RdmaHealth::kGrpcOnly:
      return "grpc-only";
  }
  return "unknown";
}

std::string ChannelTransportStats::ToString() const {
  std::string out = absl::StrCat(
      "state: ", RdmaHealthName(health), "\nrdma: ", rdma,
      "\nswitches: ", switches,
      "\nlast trigger: ", last_trigger.empty() ? "none" : last_trigger, "\n");
  if (!last_error.empty())
    absl::StrAppend(&out, "last error: ", last_error, "\n");
  absl::StrAppend(&out, "probes: ", probes);
  if (health == RdmaHealth::kDegraded) {
    absl::StrAppend(&out, " (next after about ", probe_backoff.count(), " ms)");
  }
  absl::StrAppend(&out, "\n");
  if (!last_probe_error.empty()) {
    absl::StrAppend(&out, "last probe error: ", last_probe_error, "\n");
  }
  absl::StrAppend(&out, "calls: rdma ", calls_rdma, ", grpc ", calls_grpc,
                  " (re-sent after an RDMA failure: ", calls_resent, ")\n",
                  "rdma frames sent/received: ", rdma_frames_sent, "/",
                  rdma_frames_received, ", writes: ", rdma_writes_posted,
                  " (posted aside: ", rdma_writes_posted_aside, ")",
                  ", unsignaled: ", rdma_frames_unsignaled,
                  " (flush writes: ", rdma_flush_writes, ")",
                  ", landing windows: ", rdma_landing_windows,
                  " (registrations: ", rdma_landing_registrations,
                  ", waits: ", rdma_landing_window_waits, ")",
                  ", credit frames: ", rdma_credit_frames_sent,
                  " (credits granted: ", rdma_credits_granted, ")",
                  ", waits for credit: ", rdma_waits_for_credit,
                  ", watcher wake-ups: ", rdma_watch_wakeups,
                  ", found by waiting callers: ", rdma_caller_polls,
                  ", queue arms: ", rdma_queue_arms,
                  ", callback stalls: ", rdma_callback_stalls, "\n");
  return out;
}

}  // namespace rdmarpc
