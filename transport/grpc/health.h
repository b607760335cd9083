// The standard health service (grpc.health.v1.Health) of an rdmarpc server's
// gRPC port: what each service reports, and who watches it.
//
// gRPC's own default health service is a callback service; registering one
// starts gRPC's callback-queue threads, which then poll the port's sockets
// beside the transport's threads and hand each call's events over to them
// (futex wake-ups on every call, health check or not). So the transport
// answers Check and Watch on its own completion queue (grpc_server.cc), and
// this class keeps the state both read. It handles the protocol's bytes
// without generated classes of health.proto, so a program that links its
// own health stubs gets no duplicate descriptors.
//
//   HealthStatuses health({"demo.Inference"});  // "" and each: SERVING
//   StatusOr<std::string> answer = health.Check(request_bytes);
//   health.Set("demo.Inference", false);        // watchers hear NOT_SERVING
//   health.Shutdown();                          // all NOT_SERVING, for good
#ifndef RDMARPC_TRANSPORT_GRPC_HEALTH_H_
#define RDMARPC_TRANSPORT_GRPC_HEALTH_H_

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "rdmarpc/status.h"

namespace rdmarpc::grpc_transport {

inline constexpr char kHealthCheckPath[] = "/grpc.health.v1.Health/Check";
inline constexpr char kHealthWatchPath[] = "/grpc.health.v1.Health/Watch";

// HealthCheckResponse.ServingStatus.
enum class ServingStatus : int {
  kUnknown = 0,
  kServing = 1,
  kNotServing = 2,
  kServiceUnknown = 3,  // Watch only: a service the server does not know
};

// The service name of a serialized HealthCheckRequest; INVALID_ARGUMENT for
// bytes that are not one.
StatusOr<std::string> ParseHealthRequest(std::string_view request);
// A serialized HealthCheckResponse.
std::string EncodeHealthResponse(ServingStatus status);

// One Watch stream. OnHealth runs under the HealthStatuses' lock, so it must
// not call back into it; it runs once when the watch starts, then after
// every Set that covers the service (the status may be unchanged). `final`
// is set at Shutdown (NOT_SERVING for every watcher, known service or not):
// no change comes after it.
class HealthWatcher {
 public:
  virtual ~HealthWatcher() = default;
  virtual void OnHealth(ServingStatus status, bool final) = 0;
};

class HealthStatuses {
 public:
  // "" (the whole server) and each of `services` start SERVING.
  explicit HealthStatuses(const std::vector<std::string>& services);

  // Answers a serialized HealthCheckRequest: the status of the service it
  // names, NOT_FOUND for one the server does not know (as gRPC's does).
  StatusOr<std::string> Check(std::string_view request) const;

  // Sets `service`'s status ("" sets every service's, as gRPC's
  // HealthCheckServiceInterface::SetServingStatus(bool) does) and tells its
  // watchers. Ignored after Shutdown.
  void Set(const std::string& service, bool serving);

  // Every service NOT_SERVING from now on; each watcher hears it as final.
  // Check still says NOT_FOUND for a service the server does not know.
  void Shutdown();

  // Starts telling `watcher` about `service` (SERVICE_UNKNOWN until the
  // server knows it). Unwatch before `watcher` goes; after Unwatch returns
  // no OnHealth of it runs.
  void Watch(const std::string& service, HealthWatcher* watcher);
  void Unwatch(const std::string& service, HealthWatcher* watcher);

 private:
  ServingStatus StatusLocked(const std::string& service) const;
  ServingStatus WatchedStatusLocked(const std::string& service) const;
  void TellLocked(const std::string& service);

  mutable std::mutex mu_;
  std::map<std::string, bool> serving_;                       // guarded by mu_
  std::map<std::string, std::set<HealthWatcher*>> watchers_;  // guarded by mu_
  bool shut_down_ = false;                                    // guarded by mu_
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_HEALTH_H_
