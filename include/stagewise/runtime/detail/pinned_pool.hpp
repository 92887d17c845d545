#pragma once

// HostStore's pool of pinned host buffers, keyed by size in bytes and reused step after step: a
// buffer goes back to the pool with the event of the last copy that reads it, and is handed out
// again only once that event has completed.

#include <c10/core/Event.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace stagewise::runtime::detail {

// One pinned buffer (bytes), and the copy that must complete before it is written again.
struct PinnedBuffer {
  torch::Tensor bytes;
  std::optional<c10::Event> busy_until;
};

class PinnedPool {
 public:
  // A buffer of exactly `n` bytes that no copy still reads: a free one of that size, else a new
  // pinned allocation.
  PinnedBuffer acquire(std::int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto [first, last] = free_.equal_range(n);
      for (auto it = first; it != last; ++it) {
        if (!it->second.busy_until || it->second.busy_until->query()) {
          PinnedBuffer out = std::move(it->second);
          free_.erase(it);
          out.busy_until.reset();
          return out;
        }
      }
      ++allocations_;
      bytes_ += n;
    }
    return {torch::empty({n}, torch::TensorOptions().dtype(torch::kByte).pinned_memory(true)),
            std::nullopt};
  }

  // Gives `buffer` back; `busy_until` (if any) is the event after which it may be written.
  void release(PinnedBuffer buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::int64_t n = buffer.bytes.numel();
    free_.emplace(n, std::move(buffer));
  }

  std::int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }
  std::int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }

 private:
  mutable std::mutex mutex_;
  std::multimap<std::int64_t, PinnedBuffer> free_;
  std::int64_t allocations_ = 0;
  std::int64_t bytes_ = 0;
};

}  // namespace stagewise::runtime::detail
