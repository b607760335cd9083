#include "runtime/fault_injection.h"

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace rdmarpc::internal::fault {
namespace {

struct Point {
  int times = 0;  // -1: until disarmed
  int64_t value = 0;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, Point, std::less<>> points;
  // Lets every check skip the lock while nothing is armed.
  std::atomic<int> armed{0};
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

void Arm(std::string_view name, int times, int64_t value) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.points[std::string(name)] = Point{times, value};
  r.armed.store(static_cast<int>(r.points.size()));
}

void Disarm(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (auto it = r.points.find(name); it != r.points.end()) r.points.erase(it);
  r.armed.store(static_cast<int>(r.points.size()));
}

void DisarmAll() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.points.clear();
  r.armed.store(0);
}

std::optional<int64_t> Take(std::string_view name) {
  Registry& r = registry();
  if (r.armed.load(std::memory_order_relaxed) == 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.points.find(name);
  if (it == r.points.end()) return std::nullopt;
  int64_t value = it->second.value;
  if (it->second.times > 0 && --it->second.times == 0) {
    r.points.erase(it);
    r.armed.store(static_cast<int>(r.points.size()));
  }
  return value;
}

void HoldWhileArmed(std::string_view hold, std::string_view held) {
  if (!kEnabled || !Take(hold).has_value()) return;
  Arm(held, 1);
  while (Take(hold).has_value()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace rdmarpc::internal::fault
