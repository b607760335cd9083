#include "transport/grpc/release_mutexes.h"

#include <cstdlib>
#include <string_view>

#include "absl/synchronization/mutex.h"

namespace rdmarpc::grpc_transport {

void UseReleaseModeMutexes() {
  [[maybe_unused]] static const bool applied = [] {
    const char* keep = std::getenv("RDMARPC_ABSL_DEADLOCK_DETECTION");
    if (keep != nullptr && std::string_view(keep) == "1") return false;
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    return true;
  }();
}

}  // namespace rdmarpc::grpc_transport
