// First-fit placement of blocks in one region, by offset. Not thread-safe:
// the pools that use it hold their own lock.
//
//   FirstFit fit(1 << 20);
//   std::optional<size_t> at = fit.Take(4096);  // offset, or nullopt
//   fit.Give(*at, 4096);
#ifndef RDMARPC_RUNTIME_FIRST_FIT_H_
#define RDMARPC_RUNTIME_FIRST_FIT_H_

#include <cstddef>
#include <iterator>
#include <map>
#include <optional>

namespace rdmarpc::internal {

class FirstFit {
 public:
  explicit FirstFit(size_t capacity) { free_[0] = capacity; }

  // The offset of a free block of `size` bytes, now taken.
  std::optional<size_t> Take(size_t size) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      size_t offset = it->first;
      size_t left = it->second - size;
      free_.erase(it);
      if (left > 0) free_[offset + size] = left;
      return offset;
    }
    return std::nullopt;
  }

  // Returns a block taken with Take(size), merging it with its neighbours.
  void Give(size_t offset, size_t size) {
    auto [it, inserted] = free_.emplace(offset, size);
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

 private:
  std::map<size_t, size_t> free_;  // offset -> size
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_FIRST_FIT_H_
