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
      if (left == 0) {
        free_.erase(it);
        return offset;
      }
      // The rest keeps the node: no allocation per take.
      auto node = free_.extract(it);
      node.key() = offset + size;
      node.mapped() = left;
      free_.insert(std::move(node));
      return offset;
    }
    return std::nullopt;
  }

  // Returns a block taken with Take(size), merging it with its neighbours.
  // A block next to a free one joins it without a new node.
  void Give(size_t offset, size_t size) {
    auto next = free_.lower_bound(offset);
    auto prev = next == free_.begin() ? free_.end() : std::prev(next);
    const bool joins_prev =
        prev != free_.end() && prev->first + prev->second == offset;
    const bool joins_next = next != free_.end() && offset + size == next->first;
    if (joins_prev) {
      prev->second += size;
      if (joins_next) {
        prev->second += next->second;
        free_.erase(next);
      }
    } else if (joins_next) {
      auto node = free_.extract(next);
      node.key() = offset;
      node.mapped() += size;
      free_.insert(std::move(node));
    } else {
      free_.emplace(offset, size);
    }
  }

 private:
  std::map<size_t, size_t> free_;  // offset -> size
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_FIRST_FIT_H_
