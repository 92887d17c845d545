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
  // Sharded over data-parallel replicas: the parameters this process owns (`owned[i]` for the
  // fused step's parameter i) keep optimizer state; `norms` and `found_inf`, if given, total a
  // clip's norms and a GradScaler's checks over every replica when the caller gives none.
  static void set_shard(
      optim::FusedStep& fused, std::vector<char> owned,
      std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> norms = {},
      std::function<torch::Tensor(const torch::Tensor&)> found_inf = {}) {
    auto& st = fused.state();
    TORCH_CHECK(owned.empty() || owned.size() == st.slots.size(),
                "stagewise::optim::FusedStep: ", owned.size(), " ownership flags for ",
                st.slots.size(), " parameters");
    st.owned = std::move(owned);
    st.shard_norms = std::move(norms);
    st.shard_found_inf = std::move(found_inf);
  }
  // The fused step is stepped by its caller (step_parameter), as averaged gradients arrive.
  static void set_driven(optim::FusedStep& fused, bool on) { fused.state().driven = on; }
  // Whether a norm pass is running (its parameters are measured, not stepped).
  static bool in_norm_pass(optim::FusedStep& fused) {
    return fused.state().shared.mode.load() == FusedMode::norm;
  }
  // While `on`, step_parameter leaves an offloaded parameter's update to finish_offload (a
  // data-parallel pipe's reductions step each parameter; the pipe ends the step).
  static void defer_offload_finish(optim::FusedStep& fused, bool on) {
    fused.state().shared.defer_offload_finish = on;
  }
  // Applies the offloaded parameters' updates of the step (or none, throwing).
  static void finish_offload(optim::FusedStep& fused) { fused.finish_offload(); }
  // finish_offload, then the step's counts reset (the norms of a norm pass kept).
  static void end_offloaded_step(optim::FusedStep& fused) {
    fused.finish_offload();
    fused.reset_counts();
  }
  // A norm pass of clip_grad_norm_step that totals this process's norms only is running (a pipe
  // over several processes refuses it).
  static bool measuring_alone(optim::FusedStep& fused) {
    const auto& shared = fused.state().shared;
    return shared.mode.load() == FusedMode::norm && shared.measure_norm && !shared.norms_gathered;
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
    st.shared.measure_norm = true;
    st.shared.in_passes = false;
    st.shared.scaled = nullptr;
    for (auto& slot : st.slots) slot->found_inf = torch::Tensor();
    if (done) return;
    if (st.offload) st.offload->abandon();  // no offloaded update of a failed pass is applied
    for (auto& slot : st.slots) {
      slot->arrivals.store(0);
      slot->has_norm = false;
      slot->norm = torch::Tensor();
      slot->param.mutable_grad().reset();
    }
  }
};

// What a GradScaler brings to a two-pass step (two_pass_step): the pass state the hooks unscale
// with, how to scale a loss the closure returns, how many losses it has scaled (to tell a closure
// that forgot to), and the verdict on the first pass's checks: given every parameter's found_inf
// (undefined where it got no gradient), whether the step is finite everywhere (a scaler records
// it for update() and, over several processes, reduces it first).
struct PassScaler {
  ScaledPass* pass = nullptr;
  std::function<torch::Tensor(const torch::Tensor&)> scale_loss;
  std::function<std::int64_t()> scaled_count;
  std::function<bool(const std::vector<torch::Tensor>& found_inf)> finite;
};

}  // namespace detail

namespace optim {

/// What `clip_grad_norm_step` returns: the update pass's loss (undefined when the closure runs
/// backward itself; under a GradScaler, the loss before scaling), the total gradient norm before
/// clipping, and whether the parameters stepped (false only when a GradScaler found an inf or a
/// NaN in the first pass: then no parameter and no optimizer state changed, and the loss is the
/// first pass's).
struct ClipStepResult {
  torch::Tensor loss;
  double total_norm = 0.0;
  bool stepped = true;
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

}  // namespace optim

namespace detail {

// How a two-pass fused step runs: clipping (max_norm, norm_type, gather) or not, scaled or not.
struct TwoPass {
  bool clip = false;
  double max_norm = 0.0;
  double norm_type = 2.0;
  optim::NormGather gather;
  PassScaler* scaler = nullptr;
  const char* who = "stagewise::optim::clip_grad_norm_step";
};

// The clip coefficient of the first pass's norms (clip_grad_norm_'s total over them, in
// parameter order), set for the update pass; returns the total norm (0 with no gradient).
inline double set_clip_coef(FusedState& st, const TwoPass& how) {
  std::vector<torch::Tensor> mine;
  for (auto& slot : st.slots) {
    mine.push_back(slot->has_norm ? slot->norm : torch::Tensor());
    slot->has_norm = false;
    slot->norm = torch::Tensor();
  }
  std::vector<torch::Tensor> norms;
  if (how.gather) {
    norms = how.gather(mine);
  } else if (st.shard_norms) {  // sharded replicas: every replica's norms, in parameter order
    norms = st.shard_norms(mine);
  } else {
    for (auto& n : mine) {
      if (n.defined()) norms.push_back(std::move(n));
    }
  }
  if (norms.empty()) return 0.0;  // with no gradient at all there is nothing to clip
  torch::Tensor total;
  if (how.norm_type == std::numeric_limits<double>::infinity()) {
    total = norms.size() == 1 ? norms[0] : torch::max(torch::stack(norms));
  } else if (how.norm_type == 0) {
    total = torch::full({}, static_cast<double>(norms.size()));
  } else {
    total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(how.norm_type);
  }
  st.shared.clip_coef = torch::clamp(how.max_norm / (total + 1e-6), c10::nullopt, 1.0);
  return total.item<double>();
}

// The scaler's verdict on the first pass: every parameter's found_inf; a closure that scaled no
// loss is refused (its gradients would be unscaled twice).
inline bool first_pass_finite(FusedState& st, const TwoPass& how, std::int64_t scaled_before) {
  TORCH_CHECK(how.scaler->scaled_count() > scaled_before, how.who,
              ": the closure back-propagated a loss the GradScaler did not scale, so its "
              "gradients are not scaled. Return the loss from the closure (the step scales it), "
              "call scaler.scale(loss).backward() in it, or pass the scaler to the pipe's "
              "train_step (pipe->train_step(x, y, loss_fn, fused, scaler))");
  std::vector<torch::Tensor> found;
  for (auto& slot : st.slots) found.push_back(slot->found_inf);
  return how.scaler->finite(found);
}

// The LOMO two passes of a fused step (clip_grad_norm_step, GradScaler::step(fused, closure)):
// the first pass measures each gradient (its norm when clipping; under a scaler it unscales and
// checks it first) and frees it; then, unless the scaler found an inf or a NaN, the random
// generators are rewound and the update pass steps every parameter (unscaled, clipped).
template <optim::loss_closure F>
optim::ClipStepResult two_pass_step(optim::FusedStep& fused, F& closure, const TwoPass& how) {
  auto& st = FusedStepAccess::state(fused);
  TORCH_CHECK(st.attached || st.driven, how.who,
              ": the fused step is detached. Call attach() first, or clip with "
              "torch::nn::utils::clip_grad_norm_ and step yourself.");
  TORCH_CHECK(!st.shared.in_passes, how.who,
              ": another two-pass step of this fused step is running; call it from outside the "
              "closure of clip_grad_norm_step or GradScaler::step");
  for (const auto& slot : st.slots) {
    TORCH_CHECK(slot->arrivals.load() == 0, how.who, ": ", slot->describe(),
                " is part-way through accumulating. Call it between steps: "
                "its closure runs every backward pass of the step.");
  }
  auto run = [&closure, &how]() -> torch::Tensor {
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      std::invoke(closure);
      return torch::Tensor();
    } else {
      torch::Tensor loss = std::invoke(closure);
      (how.scaler != nullptr ? how.scaler->scale_loss(loss) : loss).backward();
      return loss;
    }
  };

  FusedPassGuard guard{st};
  const auto rng = RngState::capture_all();
  st.shared.norm_type = how.norm_type;
  st.shared.norms_gathered = static_cast<bool>(how.gather) || static_cast<bool>(st.shard_norms);
  st.shared.measure_norm = how.clip;
  st.shared.in_passes = true;
  st.shared.scaled = how.scaler != nullptr ? how.scaler->pass : nullptr;
  const std::int64_t scaled_before = how.scaler != nullptr ? how.scaler->scaled_count() : 0;
  st.shared.mode.store(FusedMode::norm);
  optim::ClipStepResult result;
  result.loss = run();
  // A parameter that got fewer than k gradients (not reached by every micro-batch) counts with
  // their sum, as in clip_grad_norm_ after accumulation.
  for (auto& slot : st.slots) slot->flush();
  st.shared.mode.store(FusedMode::update);
  const bool finite = how.scaler == nullptr || first_pass_finite(st, how, scaled_before);
  if (how.clip) result.total_norm = set_clip_coef(st, how);
  if (!finite) {
    // Skipped: no parameter and no optimizer state changes, and the generators stand where one
    // forward left them, as after the unfused step GradScaler skips.
    result.stepped = false;
    guard.done = true;
    return result;
  }
  rng.restore();
  result.loss = run();
  for (auto& slot : st.slots) slot->flush();  // fewer than k gradients: stepped too
  // The step is whole: offloaded parameters take their updates now (a pipe's train_step in the
  // closure did already), and the step ends there, so that the next one may begin.
  if (st.offload) FusedStepAccess::end_offloaded_step(fused);
  guard.done = true;
  return result;
}

}  // namespace detail

namespace optim {

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
/// where the norms come from. With fp16 and a GradScaler, pass the scaler too (the overload in
/// optim/grad_scaler.hpp): the first pass then also unscales and checks every gradient.
template <loss_closure F>
ClipStepResult clip_grad_norm_step(FusedStep& fused, F&& closure, double max_norm,
                                   double norm_type = 2.0, const NormGather& gather = nullptr) {
  detail::TwoPass how;
  how.clip = true;
  how.max_norm = max_norm;
  how.norm_type = norm_type;
  how.gather = gather;
  return detail::two_pass_step(fused, closure, how);
}

}  // namespace optim
}  // namespace stagewise
