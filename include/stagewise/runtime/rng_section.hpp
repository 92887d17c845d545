#pragma once

#include "stagewise/core/rng.hpp"

#include <torch/types.h>

#include <atomic>
#include <functional>
#include <mutex>

namespace stagewise::runtime {

/// Keeps random-number draws of concurrent stages apart, so a checkpointed cell replays exactly.
///
/// The CPU generator is process-wide: if two stage workers drew from it at once, the numbers a
/// checkpointed forward drew could not be drawn again in its recompute. One section per stage
/// learns on first use whether the stage draws random numbers (its first run holds a process-wide
/// lock and compares the generator state before and after); stages that draw run under that lock
/// from then on, stages that do not never take it. Training and eval are learned separately,
/// since dropout draws only in training.
class RngSection {
 public:
  explicit RngSection(torch::Device device = torch::kCPU) : device_(device) {}

  void run(bool training, const std::function<void()>& body) {
    auto& known = state_[training ? 1 : 0];
    if (known.load(std::memory_order_acquire) == not_drawing) {
      body();
      return;
    }
    std::lock_guard<std::mutex> lock(global_mutex());
    if (known.load(std::memory_order_relaxed) == drawing) {
      body();
      return;
    }
    const auto before = RngState::capture(device_);
    body();
    known.store(RngState::capture(device_).same_as(before) ? not_drawing : drawing,
               std::memory_order_release);
  }

  /// Whether a run (in training or not) is known to draw no random numbers: such a stage runs
  /// without the lock, so it must not touch the generators either (no replay needed).
  bool draws_nothing(bool training) const {
    return state_[training ? 1 : 0].load(std::memory_order_acquire) == not_drawing;
  }

  /// The lock every drawing stage holds while it runs (process-wide, shared by all pipes).
  static std::mutex& global_mutex() {
    static auto* m = new std::mutex();  // leaked: workers may still run during static teardown
    return *m;
  }

 private:
  enum : int { unknown = 0, drawing = 1, not_drawing = 2 };

  torch::Device device_;
  std::atomic<int> state_[2] = {unknown, unknown};
};

}  // namespace stagewise::runtime
