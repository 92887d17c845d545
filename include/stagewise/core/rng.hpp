#pragma once

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/cuda.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// A snapshot of default random-number generators: the CPU generator always, plus those of the
/// devices asked for. The one place stagewise reads, compares and restores generator states.
///
/// Checkpointing takes one before a forward and restores it around the recompute, so dropout and
/// other random layers draw the same numbers twice; fused clipping replays a whole closure.
///   auto snapshot = stagewise::RngState::capture(x.device());
///   ... run something random ...
///   { stagewise::RngState::Restore replay(snapshot); ... draws the same numbers again ... }
class RngState {
 public:
  /// Captures the CPU generator and, when `device` is not the CPU, that device's generator.
  static RngState capture(const torch::Device& device) {
    RngState s;
    s.cpu_ = read(torch::kCPU);
    if (device.type() != torch::kCPU) s.devices_.emplace_back(device, read(device));
    return s;
  }

  /// Captures the CPU generator and every CUDA device's (for code that may draw anywhere).
  static RngState capture_all() {
    RngState s;
    s.cpu_ = read(torch::kCPU);
    if (torch::cuda::is_available()) {
      // device_count() is a size_t before LibTorch 2.x's DeviceIndex: compare as int.
      const int count = static_cast<int>(torch::cuda::device_count());
      for (int i = 0; i < count; ++i) {
        const torch::Device d(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
        s.devices_.emplace_back(d, read(d));
      }
    }
    return s;
  }

  /// Puts the captured generators back at the captured states.
  void restore() const {
    write(torch::kCPU, cpu_);
    for (const auto& [device, state] : devices_) write(device, state);
  }

  /// Whether every generator captured in both is at the same state in both.
  bool same_as(const RngState& other) const {
    if (!cpu_.equal(other.cpu_) || devices_.size() != other.devices_.size()) return false;
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      if (devices_[i].first != other.devices_[i].first ||
          !devices_[i].second.equal(other.devices_[i].second)) {
        return false;
      }
    }
    return true;
  }

  /// Writes the captured states into `archive` (a save's "rng" entry): the CPU generator's, then
  /// each device's with its name.
  ///   torch::serialize::OutputArchive a;
  ///   stagewise::RngState::capture_all().save(a);
  void save(torch::serialize::OutputArchive& archive) const {
    archive.write("cpu", cpu_, /*is_buffer=*/true);
    archive.write("devices", c10::IValue(static_cast<std::int64_t>(devices_.size())));
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      archive.write("device" + std::to_string(i), c10::IValue(devices_[i].first.str()));
      archive.write("state" + std::to_string(i), devices_[i].second, /*is_buffer=*/true);
    }
  }

  /// Reads states written by `save`; restore() then puts them back. A device this process does
  /// not have is an error naming it, unless `only_present`: then its state is left out (a save
  /// resumed under another plan, whose processes see other devices).
  static RngState load(torch::serialize::InputArchive& archive, bool only_present = false) {
    RngState s;
    archive.read("cpu", s.cpu_, /*is_buffer=*/true);
    c10::IValue count, name;
    archive.read("devices", count);
    for (std::int64_t i = 0; i < count.toInt(); ++i) {
      archive.read("device" + std::to_string(i), name);
      const torch::Device device(name.toStringRef());
      const bool present = device.type() != torch::kCUDA ||
                           (torch::cuda::is_available() &&
                            device.index() < static_cast<int>(torch::cuda::device_count()));
      if (!present && only_present) continue;
      TORCH_CHECK(present, "stagewise: the saved random-number states include ", device.str(),
                  "'s, which this process does not have; resume on a machine with the same "
                  "devices visible (CUDA_VISIBLE_DEVICES)");
      torch::Tensor state;
      archive.read("state" + std::to_string(i), state, /*is_buffer=*/true);
      s.devices_.emplace_back(device, state);
    }
    return s;
  }

  /// While alive, the generators are at the captured state; on destruction they go back to
  /// where they were, so code outside the replay draws as if nothing had happened.
  class Restore;

 private:
  static at::Generator generator(const torch::Device& device) {
    return at::globalContext().defaultGenerator(device);
  }
  static torch::Tensor read(const torch::Device& device) {
    auto g = generator(device);  // a handle; the lock is the generator's own
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  }
  static void write(const torch::Device& device, const torch::Tensor& state) {
    auto g = generator(device);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
  RngState same_generators_now() const {
    RngState s;
    s.cpu_ = read(torch::kCPU);
    for (const auto& [device, state] : devices_) s.devices_.emplace_back(device, read(device));
    return s;
  }

  torch::Tensor cpu_;
  std::vector<std::pair<torch::Device, torch::Tensor>> devices_;
};

class RngState::Restore {
 public:
  explicit Restore(const RngState& saved) : before_(saved.same_generators_now()) {
    saved.restore();
  }
  ~Restore() { before_.restore(); }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  RngState before_;
};

}  // namespace stagewise
