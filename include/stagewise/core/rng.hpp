#pragma once

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <mutex>
#include <optional>
#include <utility>

namespace stagewise {

/// A snapshot of the random-number generators a computation on `device` draws from: the CPU
/// generator always, and the device's own generator when it is not the CPU.
///
/// Checkpointing takes one before a forward and restores it around the recompute, so dropout and
/// other random layers draw the same numbers twice.
///   auto snapshot = stagewise::RngState::capture(x.device());
///   ... run something random ...
///   { stagewise::RngState::Restore replay(snapshot); ... draws the same numbers again ... }
class RngState {
 public:
  /// Captures the generators' states now.
  static RngState capture(const torch::Device& device) {
    RngState s;
    s.cpu_ = read(at::globalContext().defaultGenerator(torch::kCPU));
    if (device.type() != torch::kCPU) {
      s.device_ = device;
      s.device_state_ = read(at::globalContext().defaultGenerator(device));
    }
    return s;
  }

  /// While alive, the generators are at the captured state; on destruction they go back to
  /// where they were, so code outside the replay draws as if nothing had happened.
  class Restore;

  torch::Device device() const { return device_.value_or(torch::Device(torch::kCPU)); }

 private:
  static torch::Tensor read(const at::Generator& gen) {
    auto g = gen;  // a handle; the lock is the generator's own
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  }
  static void write(const at::Generator& gen, const torch::Tensor& state) {
    auto g = gen;
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
  void apply() const {
    write(at::globalContext().defaultGenerator(torch::kCPU), cpu_);
    if (device_) write(at::globalContext().defaultGenerator(*device_), device_state_);
  }

  torch::Tensor cpu_;
  std::optional<torch::Device> device_;
  torch::Tensor device_state_;
};

class RngState::Restore {
 public:
  explicit Restore(const RngState& saved) : before_(capture(saved.device())) { saved.apply(); }
  ~Restore() { before_.apply(); }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  RngState before_;
};

}  // namespace stagewise
