#pragma once

#include "stagewise/optim/optimizer_for.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace stagewise::optim {

/// One parameter's optimizer state as a store keeps it: its tensors, in the state's own order
/// (undefined where the state has none, e.g. Adam's `max_exp_avg_sq` without AMSGrad), and its
/// step count (0 for a state without one, SGD's). A record without tensors is no state at all (a
/// parameter that never stepped). `runtime::HostStore` and `runtime::FileStore` keep them
/// (`runtime::state_store`).
///   sw::optim::StateRecord r{{exp_avg, exp_avg_sq, torch::Tensor()}, /*step=*/10};
struct StateRecord {
  std::vector<torch::Tensor> tensors;
  std::int64_t step = 0;

  /// Whether it holds a state (some tensor).
  bool empty() const { return tensors.empty(); }
  /// The bytes of its defined tensors.
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const auto& t : tensors) n += t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0;
    return n;
  }
};

/// Which parameters `share` of the bytes keeps off the device: whole tensors, largest first
/// (equal sizes in their order), each one that still fits within `share` of the total bytes.
/// `share` 1 takes every parameter, 0 none; a parameter's state is wholly in one place, so the
/// step that updates it is the optimizer's own, on one device. Both `runtime::OffloadedState`
/// (the parameters it holds) and `plan_pipeline` (what it predicts) choose with it.
///   sw::optim::choose_offloaded({4096, 64, 4096, 64}, 0.5);  // {true, true, false, false}
inline std::vector<bool> choose_offloaded(const std::vector<std::int64_t>& bytes, double share) {
  TORCH_CHECK(share >= 0.0 && share <= 1.0, "stagewise::optim::choose_offloaded: the share is ",
              share, "; give a share of the bytes from 0 (none) to 1 (all)");
  std::vector<bool> out(bytes.size(), share >= 1.0);
  if (share >= 1.0 || share <= 0.0) return out;
  std::vector<std::size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  const double total =
      static_cast<double>(std::accumulate(bytes.begin(), bytes.end(), std::int64_t{0}));
  double taken = 0;
  for (std::size_t i : order) {
    const auto b = static_cast<double>(bytes[i]);
    if (taken + b > share * total) continue;
    taken += b;
    out[i] = true;
  }
  return out;
}

/// Where some of an optimizer's parameters keep their state and take their step, away from the
/// device the parameters live on: `FusedStep::offload_state` and `OffloadedOptimizer` take one.
/// `runtime::OffloadedState` is stagewise's (a share of the parameters, their state in a
/// `HostStore` or a `FileStore`, stepped on host threads); implement this to keep state
/// elsewhere. The optimizer calls, in order: `bind` once; per step, `step` for each held
/// parameter whose gradient is final (it returns at once: the step runs elsewhere), then
/// `finish` (the step's end: every held parameter updated, or none and an error) or `abandon`
/// (a failed step: nothing changes); between steps `state` and `set_state` (saves and loads).
///   fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore(), 1.0));
class StateOffload {
 public:
  virtual ~StateOffload() = default;

  /// The optimizer's parameters (`names`: one per parameter, or empty) and the factory that
  /// builds its optimizer over the tensors it is given (one parameter's host step); which of
  /// them it holds is its choice (`holds`). Once, before anything else.
  virtual void bind(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
                    const OptimizerFactory& factory) = 0;
  /// Whether it holds parameter `i`'s state (and steps it).
  virtual bool holds(std::size_t i) const = 0;
  /// Parameter `i`'s gradient is final for this step: step it, with `options` (the optimizer's
  /// current ones: learning rate, betas, ...), off the caller's thread. The caller drops its own
  /// reference to `grad` next. The parameter may change only in `finish`.
  virtual void step(std::size_t i, const torch::Tensor& grad,
                    const torch::optim::OptimizerOptions& options) = 0;
  /// Ends the step on the caller's thread: waits for every step handed over, then updates every
  /// parameter and keeps its new state; if any step failed, changes no parameter and no state and
  /// throws an error naming it.
  virtual void finish() = 0;
  /// Ends a failed step: waits for the steps handed over and drops them; nothing changes.
  virtual void abandon() = 0;
  /// Parameter `i`'s state as its optimizer would hold it (null: none yet); between steps.
  virtual std::unique_ptr<torch::optim::OptimizerParamState> state(std::size_t i) = 0;
  /// Makes `state` (null: none) parameter `i`'s state; between steps.
  virtual void set_state(std::size_t i,
                         std::unique_ptr<torch::optim::OptimizerParamState> state) = 0;
  /// Names it in errors ("runtime::OffloadedState in HostStore (pinned host memory)").
  virtual std::string describe() const = 0;
};

}  // namespace stagewise::optim
