// Named fault points, compiled into test builds (RDMARPC_FAULT_INJECTION).
//
// A test arms a point; the code that checks it then misbehaves on purpose
// (drops frames, refuses connects, breaks a queue pair) so the fallback
// paths can be driven on real hardware or soft-RoCE. In a build without
// fault injection every check is a constant false.
//
//   fault::Arm("rdma.server.ignore_frames");           // until disarmed
//   fault::Arm("rdma.client.qp_error", /*times=*/1);    // once
//   fault::Arm("rdma.server.accept_delay_ms", -1, 800); // with a value
//   ...
//   if (RDMARPC_FAULT("rdma.server.ignore_frames")) return;
//
// Points in use are listed in docs/design.md ("Fault injection").
#ifndef RDMARPC_RUNTIME_FAULT_INJECTION_H_
#define RDMARPC_RUNTIME_FAULT_INJECTION_H_

#include <cstdint>
#include <optional>
#include <string_view>

namespace rdmarpc::internal::fault {

#ifdef RDMARPC_FAULT_INJECTION
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

// The next `times` checks of `name` fire (-1: every check until Disarm),
// each seeing `value`.
void Arm(std::string_view name, int times = -1, int64_t value = 0);
void Disarm(std::string_view name);
void DisarmAll();

// Consumes one firing of `name`: its value, or nullopt when not armed.
std::optional<int64_t> Take(std::string_view name);
// While `hold` is armed, waits, having armed `held` once: a test arms
// `hold`, takes `held` to know a thread is waiting here, then disarms
// `hold` to let it go. Returns at once when `hold` is not armed.
void HoldWhileArmed(std::string_view hold, std::string_view held);

}  // namespace rdmarpc::internal::fault

// True when the fault point `name` fires (never in a build without fault
// injection).
#define RDMARPC_FAULT(name)                \
  (::rdmarpc::internal::fault::kEnabled && \
   ::rdmarpc::internal::fault::Take(name).has_value())

#endif  // RDMARPC_RUNTIME_FAULT_INJECTION_H_
