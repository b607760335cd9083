#include "transport/grpc/health.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"

namespace rdmarpc::grpc_transport {

StatusOr<std::string> ParseHealthRequest(std::string_view request) {
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromArray(request.data(),
                             static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError(
        "health check request is not a grpc.health.v1.HealthCheckRequest");
  }
  std::string service;
  for (int i = 0; i < fields.field_count(); ++i) {
    const google::protobuf::UnknownField& f = fields.field(i);
    if (f.number() != 1) continue;  // unknown fields are skipped, as protobuf
    if (f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      return absl::InvalidArgumentError(
          "health check request: field 1 (service) is not a string");
    }
    service = f.length_delimited();  // the last one wins, as protobuf
  }
  return service;
}

std::string EncodeHealthResponse(ServingStatus status) {
  google::protobuf::UnknownFieldSet fields;
  // proto3 leaves a zero field out.
  if (status != ServingStatus::kUnknown) {
    fields.AddVarint(1, static_cast<uint64_t>(status));
  }
  std::string out;
  fields.SerializeToString(&out);
  return out;
}

HealthStatuses::HealthStatuses(const std::vector<std::string>& services) {
  serving_[""] = true;
  for (const std::string& s : services) serving_[s] = true;
}

StatusOr<std::string> HealthStatuses::Check(std::string_view request) const {
  RDMARPC_ASSIGN_OR_RETURN(std::string service, ParseHealthRequest(request));
  std::lock_guard<std::mutex> lock(mu_);
  ServingStatus status = StatusLocked(service);
  if (status == ServingStatus::kServiceUnknown) {
    return absl::NotFoundError(
        absl::StrCat("health: service '", service, "' is not served here"));
  }
  return EncodeHealthResponse(status);
}

void HealthStatuses::Set(const std::string& service, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return;
  if (!service.empty()) {
    serving_[service] = serving;
    return TellLocked(service);
  }
  for (auto& [name, value] : serving_) value = serving;
  for (const auto& [name, watching] : watchers_) TellLocked(name);
}

void HealthStatuses::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& [name, value] : serving_) value = false;
  for (const auto& [name, watching] : watchers_) TellLocked(name);
}

void HealthStatuses::Watch(const std::string& service, HealthWatcher* watcher) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_[service].insert(watcher);
  watcher->OnHealth(WatchedStatusLocked(service), shut_down_);
}

void HealthStatuses::Unwatch(const std::string& service,
                             HealthWatcher* watcher) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = watchers_.find(service);
  if (it == watchers_.end()) return;
  it->second.erase(watcher);
  if (it->second.empty()) watchers_.erase(it);
}

ServingStatus HealthStatuses::StatusLocked(const std::string& service) const {
  auto it = serving_.find(service);
  if (it == serving_.end()) return ServingStatus::kServiceUnknown;
  return it->second ? ServingStatus::kServing : ServingStatus::kNotServing;
}

ServingStatus HealthStatuses::WatchedStatusLocked(
    const std::string& service) const {
  // After shutdown every watcher hears NOT_SERVING, known service or not.
  return shut_down_ ? ServingStatus::kNotServing : StatusLocked(service);
}

void HealthStatuses::TellLocked(const std::string& service) {
  auto it = watchers_.find(service);
  if (it == watchers_.end()) return;
  const ServingStatus status = WatchedStatusLocked(service);
  for (HealthWatcher* w : it->second) w->OnHealth(status, shut_down_);
}

}  // namespace rdmarpc::grpc_transport
