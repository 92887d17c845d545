#pragma once

#include "stagewise/optim/optimizer_for.hpp"
#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/detail/host_steps.hpp"
#include "stagewise/runtime/offload_store.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// Optimizer state off the device, and its step on the host (ZeRO-Offload's idea, per parameter):
/// for the parameters it holds, the optimizer's state (Adam's moments and step, SGD's momentum,
/// ...) lives in `store` (`HostStore`: host memory; `FileStore`: a file per parameter, for state
/// larger than host memory), and their step runs on host threads: the final gradient and the
/// parameter's value are copied to the host (on a GPU: pinned buffers, a copy stream of their
/// own, queued in the gradient's hook after the work that made it; the device's gradient is freed
/// once copied), the optimizer's own step runs there on CPU tensors (so on the CPU the result is
/// bit-identical to the step on the device), and the new value is copied back at the step's end.
/// With `optim::FusedStep` the copies and host steps overlap the rest of backward; with
/// `optim::OffloadedOptimizer` they run in its `step()`. A step updates every held parameter or,
/// when one host step fails (a store that fills), none: parameters and state stay as they were.
/// Which parameters: `share` of the bytes, whole tensors, largest first (`optim::choose_offloaded`;
/// 1: all), or exactly the tensors given. Holds SGD's, Adam's, AdamW's, RMSprop's and Adagrad's
/// state. Give it to one optimizer (it binds to that optimizer's parameters).
///   sw::optim::FusedStep fused(model->named_parameters(), torch::optim::AdamOptions(1e-3));
///   fused.offload_state(sw::runtime::OffloadedState(sw::runtime::FileStore("/nvme/state"), 0.5));
class OffloadedState final : public optim::StateOffload {
 public:
  /// `share` (0 to 1) of the optimizer's parameters' bytes, largest first, in `store`.
  explicit OffloadedState(AnyStore store, double share = 1.0)
      : steps_(std::make_unique<detail::HostSteps>(std::move(store), kWho)), share_(share) {
    TORCH_CHECK(share >= 0.0 && share <= 1.0, kWho, ": the share is ", share,
                "; give a share of the parameters' bytes from 0 (none) to 1 (all)");
  }
  /// Exactly `params` (each one of the optimizer's parameters) in `store`.
  OffloadedState(AnyStore store, std::vector<torch::Tensor> params)
      : steps_(std::make_unique<detail::HostSteps>(std::move(store), kWho)),
        chosen_(std::move(params)) {}

  void bind(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
            const optim::OptimizerFactory& factory) override {
    std::vector<bool> chosen;
    if (chosen_) {
      chosen.assign(params.size(), false);
      for (const auto& t : *chosen_) {
        std::size_t i = 0;
        while (i < params.size() && !params[i].is_same(t)) ++i;
        TORCH_CHECK(i < params.size(), kWho, ": a tensor of shape ", t.sizes(),
                    " it was given to hold is not one of the optimizer's parameters; give it "
                    "parameters the optimizer steps");
        chosen[i] = true;
      }
    } else {
      std::vector<std::int64_t> bytes;
      for (const auto& p : params) bytes.push_back(static_cast<std::int64_t>(p.nbytes()));
      chosen = optim::choose_offloaded(bytes, share_);
    }
    steps_->bind(params, names, factory, chosen);
  }
  bool holds(std::size_t i) const override { return steps_->holds(i); }
  void step(std::size_t i, const torch::Tensor& grad,
            const torch::optim::OptimizerOptions& options) override {
    steps_->submit(i, grad, options);
  }
  void finish() override { steps_->finish(); }
  void abandon() override { steps_->abandon(); }
  std::unique_ptr<torch::optim::OptimizerParamState> state(std::size_t i) override {
    return steps_->state(i);
  }
  void set_state(std::size_t i, std::unique_ptr<torch::optim::OptimizerParamState> s) override {
    steps_->set_state(i, std::move(s));
  }
  std::string describe() const override {
    return std::string("runtime::OffloadedState in ") + steps_->store();
  }

  /// How many parameters it holds, and their bytes (their state's is a multiple: 2x for Adam).
  std::size_t size() const { return steps_->size(); }
  std::int64_t parameter_bytes() const { return steps_->held_bytes(); }
  /// Bytes copied between the parameters' devices and the host in the last finished step:
  /// each stepped parameter's gradient and value to the host, and its new value back.
  std::int64_t bytes_moved_last_step() const { return steps_->moved_last_step(); }

 private:
  static constexpr const char* kWho = "stagewise::runtime::OffloadedState";
  std::unique_ptr<detail::HostSteps> steps_;
  double share_ = 1.0;
  std::optional<std::vector<torch::Tensor>> chosen_;
};

}  // namespace stagewise::runtime
