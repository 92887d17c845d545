#pragma once

#include "stagewise/core/rng.hpp"
#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/fused_step.hpp"

#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {
namespace detail {

struct FusedStepAccess {
  static FusedState& state(optim::FusedStep& fused) { return fused.state(); }
  // Ends a step whose parameters were stepped by step_parameter (a data-parallel pipe's
  // reductions): the counts reset, the norms of a norm pass kept for the clip.
  static void reset_counts(optim::FusedStep& fused) { fused.reset_counts(); }
  // A norm pass of clip_grad_norm_step that totals this process's norms only is running (a pipe
  // over several processes refuses it).
  static bool measuring_alone(optim::FusedStep& fused) {
    const auto& shared = fused.state().shared;
    return shared.mode.load() == FusedMode::norm && !shared.norms_gathered;
  }
};

// Puts the hooks back in update mode and drops half-done work if a pass throws.
struct FusedPassGuard {
  FusedState& st;
  bool done = false;
  ~FusedPassGuard() {
    st.shared.mode.store(FusedMode::update);
    st.shared.clip_coef = torch::Tensor();
    st.shared.norms_gathered = false;
    if (done) return;
    for (auto& slot : st.slots) {
      slot->arrivals.store(0);
      slot->has_norm = false;
      slot->norm = torch::Tensor();
      slot->param.mutable_grad().reset();
    }
  }
};

}  // namespace detail

namespace optim {

/// What `clip_grad_norm_step` returns: the update pass's loss (undefined when the closure runs
/// backward itself) and the total gradient norm before clipping.
struct ClipStepResult {
  torch::Tensor loss;
  double total_norm = 0.0;
};

/// A closure for `clip_grad_norm_step`: returns the loss (it then runs `loss.backward()`), or
/// returns nothing and runs its own backward passes (e.g. one per micro-batch).
template <class F>
concept loss_closure = std::invocable<F&> &&
    (std::same_as<std::invoke_result_t<F&>, torch::Tensor> ||
     std::is_void_v<std::invoke_result_t<F&>>);

/// Where the norms a clip totals come from (`clip_grad_norm_step`'s last argument): given this
/// process's per-parameter gradient norms (`mine[i]`: the fused step's parameter i, as
/// `grad.norm(norm_type)`; undefined where it got no gradient), returns every norm of the whole
/// model to total, in the model's parameter order, without the undefined ones. Every process
/// calls it once per clipped step and must get the same list. A pipe's
/// (`pipe->clip_grad_norm_step`) gathers them from every process of a distributed pipe; null: this
/// process's norms alone.
using NormGather =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& mine)>;

/// One fused step with global gradient-norm clipping, the LOMO way: the closure runs twice. The
/// norm pass only records each parameter's gradient norm and frees the gradient; then, with the
/// CPU and CUDA random generators rewound so dropout draws the same masks, the update pass
/// multiplies each gradient by min(1, max_norm / (total_norm + 1e-6)) and steps. The result is
/// bit-identical to `torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type)` followed by
/// the unfused step, at the price of a second forward and backward.
///
/// The closure must compute the same thing both times: take the batch outside it, and note that
/// side effects (BatchNorm running statistics, counters) happen twice.
///   auto r = sw::optim::clip_grad_norm_step(fused, [&] { return loss_fn(model(x), y); }, 1.0);
/// The norm is that of this process's parameters: on a distributed pipe (stages on several
/// ranks) call `pipe->clip_grad_norm_step(fused, closure, max_norm)` instead, which totals every
/// rank's (its fused train_step refuses a norm pass of this one). `gather` (`NormGather`) says
/// where the norms come from.
template <loss_closure F>
ClipStepResult clip_grad_norm_step(FusedStep& fused, F&& closure, double max_norm,
                                   double norm_type = 2.0, const NormGather& gather = nullptr) {
  auto& st = detail::FusedStepAccess::state(fused);
  TORCH_CHECK(st.attached,
              "stagewise::optim::clip_grad_norm_step: the fused step is detached. Call "
              "attach() first, or clip with torch::nn::utils::clip_grad_norm_ and step yourself.");
  for (const auto& slot : st.slots) {
    TORCH_CHECK(slot->arrivals.load() == 0,
                "stagewise::optim::clip_grad_norm_step: ", slot->describe(),
                " is part-way through accumulating. Call it between steps: "
                "its closure runs every backward pass of the step.");
  }
  auto run = [&closure]() -> torch::Tensor {
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      std::invoke(closure);
      return torch::Tensor();
    } else {
      torch::Tensor loss = std::invoke(closure);
      loss.backward();
      return loss;
    }
  };

  detail::FusedPassGuard guard{st};
  const auto rng = RngState::capture_all();
  st.shared.norm_type = norm_type;
  st.shared.norms_gathered = static_cast<bool>(gather);
  st.shared.mode.store(detail::FusedMode::norm);
  run();
  // A parameter that got fewer than k gradients (not reached by every micro-batch) counts with
  // their sum, as in clip_grad_norm_ after accumulation.
  for (auto& slot : st.slots) slot->flush();
  st.shared.mode.store(detail::FusedMode::update);

  // The total, as clip_grad_norm_ computes it: per-parameter norms in parameter order, stacked.
  std::vector<torch::Tensor> mine;
  for (auto& slot : st.slots) {
    mine.push_back(slot->has_norm ? slot->norm : torch::Tensor());
    slot->has_norm = false;
    slot->norm = torch::Tensor();
  }
  std::vector<torch::Tensor> norms;
  if (gather) {
    norms = gather(mine);
  } else {
    for (auto& n : mine) {
      if (n.defined()) norms.push_back(std::move(n));
    }
  }
  double total_norm = 0.0;  // with no gradient at all there is nothing to clip
  if (!norms.empty()) {
    torch::Tensor total;
    if (norm_type == std::numeric_limits<double>::infinity()) {
      total = norms.size() == 1 ? norms[0] : torch::max(torch::stack(norms));
    } else if (norm_type == 0) {
      total = torch::full({}, static_cast<double>(norms.size()));
    } else {
      total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(norm_type);
    }
    st.shared.clip_coef = torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    total_norm = total.item<double>();
  }

  rng.restore();
  ClipStepResult result;
  result.loss = run();
  for (auto& slot : st.slots) slot->flush();  // fewer than k gradients: clipped and stepped too
  result.total_norm = total_norm;
  guard.done = true;
  return result;
}

}  // namespace optim
}  // namespace stagewise
