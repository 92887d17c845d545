#pragma once

// amp::GradScaler: dynamic loss scaling for fp16 training, with PyTorch's semantics
// (torch.amp.GradScaler), for plain LibTorch, the fused step and the pipes.

#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/detail/amp_kernels.hpp"
#include "stagewise/optim/detail/fused_slot.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/optim/grad_scaler_options.hpp"
#include "stagewise/optim/job_wide_checks.hpp"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {
namespace amp {
class GradScaler;
}  // namespace amp

namespace detail {
// The found-inf reduction of a step over several processes: given this process's sum of
// found_inf (a one-element float tensor), every process's sum.
using FoundInfReduction = std::function<torch::Tensor(const torch::Tensor&)>;
struct GradScalerAccess;  // below: what the pipes use of a GradScaler
}  // namespace detail

namespace amp {

/// Dynamic loss scaling for fp16 training, as PyTorch's `torch.amp.GradScaler`, which LibTorch
/// lacks: the loss is multiplied by a large scale before backward so that small fp16 gradients do
/// not flush to zero; the gradients are divided by it again before the optimizer steps; a step
/// whose gradients hold an inf or a NaN is skipped and the scale backed off, and after
/// `growth_interval` clean steps it grows. Same rules, defaults, errors and state as PyTorch's.
///   sw::amp::GradScaler scaler;
///   for (...) {
///     optimizer.zero_grad();
///     { autocast on (fp16): loss = loss_fn(model->forward(x), y); }
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);                              // optional: to clip
///     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     bool stepped = scaler.step(optimizer);                   // skipped on inf/NaN
///     scaler.update();
///   }
/// With the optimizer fused into backward (`optim::FusedStep`) use `step(fused, closure)` or
/// `optim::clip_grad_norm_step(fused, closure, max_norm, scaler)`: no parameter is updated
/// before the whole step is known to be finite. A pipe's `train_step(x, y, loss_fn, scaler)`
/// scales each micro-batch's loss (docs/mixed_precision.md).
class GradScaler {
 public:
  /// A scaler with `options` (PyTorch's defaults if none).
  explicit GradScaler(GradScalerOptions options = {}) : options_(options) {
    if (!options_.enabled()) return;
    TORCH_CHECK(options_.growth_factor() > 1.0, "stagewise::amp::GradScaler: growth_factor is ",
                options_.growth_factor(), "; the growth factor must be > 1.0");
    TORCH_CHECK(options_.backoff_factor() < 1.0, "stagewise::amp::GradScaler: backoff_factor is ",
                options_.backoff_factor(), "; the backoff factor must be < 1.0");
  }

  /// `outputs` times the scale (on their device); the first call creates the scale on that
  /// device. A disabled scaler returns `outputs`.
  ///   scaler.scale(loss).backward();
  torch::Tensor scale(const torch::Tensor& outputs) {
    if (!enabled()) return outputs;
    ++scaled_;
    return outputs * scale_on(outputs.device());
  }
  /// Each of `outputs` times the scale.
  std::vector<torch::Tensor> scale(const std::vector<torch::Tensor>& outputs) {
    std::vector<torch::Tensor> out;
    for (const auto& t : outputs) out.push_back(scale(t));
    return out;
  }

  /// Divides the gradients of `optimizer`'s parameters by the scale, in place, and records
  /// whether any holds an inf or a NaN; for clipping or reading unscaled gradients before `step`.
  /// Once per optimizer per step: a second call before `update()` is an error, as in PyTorch.
  /// FP16 gradients are refused (keep the parameters fp32 and autocast the forward).
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!enabled()) return;
    check_scaled("unscale_");
    auto& st = states_[&optimizer];
    TORCH_CHECK(st.stage != Stage::unscaled,
                "stagewise::amp::GradScaler::unscale_: unscale_() has already been called on this "
                "optimizer since the last update(). Call it once per step, before step()");
    TORCH_CHECK(st.stage != Stage::stepped,
                "stagewise::amp::GradScaler::unscale_: unscale_() is being called after step(). "
                "Call it before step(), or call update() first to begin the next step");
    st.found_inf = unscale_grads(optimizer);
    st.stage = Stage::unscaled;
  }

  /// Unscales `optimizer`'s gradients (unless `unscale_` already did) and calls
  /// `optimizer.step()` unless one held an inf or a NaN; returns whether it stepped. A disabled
  /// scaler just steps.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!enabled()) {
      optimizer.step();
      return true;
    }
    check_scaled("step");
    auto& st = states_[&optimizer];
    TORCH_CHECK(st.stage != Stage::stepped,
                "stagewise::amp::GradScaler::step: step() has already been called since the last "
                "update(). Call update() once per step, after every optimizer's step()");
    if (st.stage == Stage::ready) unscale_(optimizer);
    TORCH_CHECK(!st.found_inf.empty(),
                "stagewise::amp::GradScaler::step: no inf checks were recorded for this "
                "optimizer: none of its parameters has a gradient. Run backward on a scaled "
                "loss first");
    const bool finite = !any_found(st.found_inf);
    if (finite) optimizer.step();
    st.stage = Stage::stepped;
    return finite;
  }

  /// The scaled step of an optimizer fused into backward (`optim::FusedStep`), LOMO's way:
  /// `closure` runs twice. The first pass unscales and checks every gradient and frees it; then,
  /// only if none held an inf or a NaN, the random generators are rewound and the second pass
  /// steps every parameter on its unscaled gradient; otherwise no parameter and no optimizer
  /// state changes. Returns whether it stepped; bit-identical to `scale(loss).backward();
  /// step(optimizer)` with the unfused optimizer. A closure that returns its loss has it scaled
  /// here; one that runs its own backward must scale its loss (`scale(loss).backward()`, or a
  /// pipe's `train_step(x, y, loss_fn, fused, scaler)`). A disabled scaler runs it once.
  ///   bool stepped = scaler.step(fused, [&] { return loss_fn(model->forward(x), y); });
  ///   fused.finish_step();
  ///   scaler.update();
  template <optim::loss_closure F>
  bool step(optim::FusedStep& fused, F&& closure) {
    if (!enabled()) {
      run_plain(closure);
      return true;
    }
    return passes(fused, closure, false, 0.0, 2.0, nullptr).stepped;
  }

  /// Updates the scale after a step: backed off if any optimizer's step (or a fused step) found
  /// an inf or a NaN, grown after `growth_interval` clean steps in a row; then begins the next
  /// step. Call it once per step, after every `step`.
  void update() {
    if (!enabled()) return;
    check_scaled("update");
    std::vector<torch::Tensor> found;
    for (const auto& [key, st] : states_) {
      for (const auto& f : st.found_inf) found.push_back(f.to(scale_.device()));
    }
    TORCH_CHECK(!found.empty(),
                "stagewise::amp::GradScaler::update: no inf checks were recorded prior to "
                "update(). Call step(optimizer) (or unscale_) first in every step");
    torch::Tensor combined = found.front().clone();
    for (std::size_t i = 1; i < found.size(); ++i) combined += found[i];
    detail::update_scale(scale_, growth_tracker_, combined, options_.growth_factor(),
                         options_.backoff_factor(), options_.growth_interval());
    next_step();
  }
  /// Sets the scale to `new_scale` (instead of the rule) and begins the next step.
  void update(double new_scale) {
    if (!enabled()) return;
    check_scaled("update");
    scale_.fill_(new_scale);
    next_step();
  }
  /// Sets the scale to the value of `new_scale` (one element, no grad, on the scale's kind of
  /// device) and begins the next step.
  void update(const torch::Tensor& new_scale) {
    if (!enabled()) return;
    check_scaled("update");
    TORCH_CHECK(new_scale.numel() == 1 && !new_scale.requires_grad() &&
                    new_scale.device().type() == scale_.device().type(),
                "stagewise::amp::GradScaler::update: new_scale should be a float or a 1-element "
                "tensor with requires_grad=false on the scale's device type (",
                scale_.device().type(), ")");
    scale_.copy_(new_scale);
    next_step();
  }

  /// The current scale (the initial one before the first `scale`); 1 when disabled.
  double get_scale() const {
    if (!enabled()) return 1.0;
    return scale_.defined() ? scale_.item<double>() : init_scale_;
  }
  /// The number of clean steps in a row since the scale last changed.
  std::int64_t growth_tracker() const {
    if (!enabled()) return 0;
    return growth_tracker_.defined() ? growth_tracker_.item<std::int64_t>() : init_tracker_;
  }
  /// The growth factor, and setting it.
  double get_growth_factor() const { return options_.growth_factor(); }
  void set_growth_factor(double f) { options_.growth_factor(f); }
  /// The backoff factor, and setting it.
  double get_backoff_factor() const { return options_.backoff_factor(); }
  void set_backoff_factor(double f) { options_.backoff_factor(f); }
  /// The growth interval, and setting it.
  std::int64_t get_growth_interval() const { return options_.growth_interval(); }
  void set_growth_interval(std::int64_t n) { options_.growth_interval(n); }
  /// Whether the scaler is enabled.
  bool is_enabled() const { return enabled(); }

  /// Saves the scale, the growth tracker and the factors (PyTorch's state_dict entries); a
  /// disabled scaler saves nothing. Call it between steps (after `update()`).
  /// `torch::save(scaler, path)` calls it.
  void save(torch::serialize::OutputArchive& archive) const {
    if (!enabled()) return;
    TORCH_CHECK(states_.empty(),
                "stagewise::amp::GradScaler::save: a step is under way (step or unscale_ ran "
                "since the last update()); save the scaler after update()");
    archive.write("scale", c10::IValue(get_scale()));
    archive.write("growth_factor", c10::IValue(options_.growth_factor()));
    archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
    archive.write("growth_interval", c10::IValue(options_.growth_interval()));
    archive.write("_growth_tracker", c10::IValue(growth_tracker()));
  }
  /// Loads what `save` wrote; a disabled scaler loads nothing. `torch::load(scaler, path)`.
  void load(torch::serialize::InputArchive& archive) {
    if (!enabled()) return;
    c10::IValue v;
    TORCH_CHECK(archive.try_read("scale", v),
                "stagewise::amp::GradScaler::load: the saved state is empty, possibly because it "
                "was saved from a disabled GradScaler");
    init_scale_ = v.toDouble();
    if (scale_.defined()) scale_.fill_(init_scale_);
    archive.read("growth_factor", v);
    options_.growth_factor(v.toDouble());
    archive.read("backoff_factor", v);
    options_.backoff_factor(v.toDouble());
    archive.read("growth_interval", v);
    options_.growth_interval(v.toInt());
    archive.read("_growth_tracker", v);
    init_tracker_ = v.toInt();
    if (growth_tracker_.defined()) growth_tracker_.fill_(init_tracker_);
  }

 private:
  friend struct detail::GradScalerAccess;

  enum class Stage { ready, unscaled, stepped };
  struct OptimizerState {
    Stage stage = Stage::ready;
    std::vector<torch::Tensor> found_inf;  // one per device
  };

  bool enabled() const { return options_.enabled(); }

  void check_scaled(const char* what) const {
    TORCH_CHECK(scale_.defined(), "stagewise::amp::GradScaler::", what, ": attempted ", what,
                " but the scale is not set. This may indicate your program did not use "
                "scaler.scale(loss) (or a pipe's train_step with the scaler) earlier in the step");
  }

  // The scale on `device`, made there first if there is none yet (PyTorch's lazy init).
  torch::Tensor scale_on(const c10::Device& device) {
    if (!scale_.defined()) {
      scale_ = torch::full({}, init_scale_, torch::TensorOptions(torch::kFloat).device(device));
      growth_tracker_ = torch::full({}, init_tracker_, torch::TensorOptions(torch::kInt).device(device));
    }
    return scale_.device() == device ? scale_ : scale_.to(device, /*non_blocking=*/true);
  }

  // Unscales the gradients of `optimizer`, grouped by device and dtype as PyTorch does; returns
  // each device's found_inf (over several processes: one, the job's, reduced).
  std::vector<torch::Tensor> unscale_grads(torch::optim::Optimizer& optimizer) {
    torch::NoGradGuard no_grad;
    const auto inv = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
    std::vector<std::pair<c10::Device, torch::Tensor>> found, invs;  // per device
    std::vector<std::pair<std::pair<c10::Device, c10::ScalarType>, std::vector<torch::Tensor>>>
        groups;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto g = p.grad().is_sparse() ? p.grad()._values() : p.grad();
        TORCH_CHECK(g.scalar_type() != torch::kHalf,
                    "stagewise::amp::GradScaler::unscale_: attempting to unscale FP16 gradients. "
                    "Keep the parameters in fp32 and run the forward under fp16 autocast "
                    "instead of converting the model to fp16");
        const std::pair<c10::Device, c10::ScalarType> key{g.device(), g.scalar_type()};
        auto it = std::find_if(groups.begin(), groups.end(),
                               [&](const auto& e) { return e.first == key; });
        if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
        it->second.push_back(g);
      }
    }
    auto on = [](auto& list, const c10::Device& d, auto make) -> torch::Tensor& {
      for (auto& [device, t] : list) {
        if (device == d) return t;
      }
      list.emplace_back(d, make());
      return list.back().second;
    };
    for (auto& [key, grads] : groups) {
      const auto& d = key.first;
      auto& f = on(found, d, [&] { return torch::zeros({}, inv.options().device(d)); });
      auto& i = on(invs, d, [&] { return inv.to(d, false, /*copy=*/true); });
      detail::unscale_and_check(grads, f, i);
    }
    std::vector<torch::Tensor> out;
    for (auto& [d, f] : found) out.push_back(f);
    detail::FoundInfReduction spread;  // a sharded optimizer's: its checks span the job
    if (auto* job = dynamic_cast<optim::JobWideChecks*>(&optimizer)) {
      spread = [job](const torch::Tensor& sum) { return job->sum_found_inf(sum); };
    }
    return reduced(std::move(out), spread);
  }

  // Over several processes (a pipe's reduction for this step, else `fallback`: a sharded
  // optimizer's), the job's sum of `found`.
  std::vector<torch::Tensor> reduced(std::vector<torch::Tensor> found,
                                     const detail::FoundInfReduction& fallback = nullptr) {
    const auto& reduction = reduction_ ? reduction_ : fallback;
    if (!reduction) return found;
    auto sum = torch::zeros({}, scale_.options());
    for (const auto& f : found) sum += f.to(scale_.device());
    return {reduction(sum).to(scale_.device())};
  }

  static bool any_found(const std::vector<torch::Tensor>& found) {
    for (const auto& f : found) {
      if (f.item<float>() != 0.f) return true;
    }
    return false;
  }

  template <class F>
  static void run_plain(F& closure) {
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      std::invoke(closure);
    } else {
      std::invoke(closure).backward();
    }
  }

  // The two passes of a scaled fused step (detail::two_pass_step), clipping or not.
  template <class F>
  optim::ClipStepResult passes(optim::FusedStep& fused, F& closure, bool clip, double max_norm,
                               double norm_type, const optim::NormGather& gather) {
    auto& st = states_[&fused];
    TORCH_CHECK(st.stage == Stage::ready,
                "stagewise::amp::GradScaler::step: step() has already been called since the last "
                "update(). Call update() once per step, after every optimizer's step()");
    detail::ScaledPass pass;
    pass.owner = this;
    pass.scale = &scale_;
    detail::PassScaler scaler;
    scaler.pass = &pass;
    scaler.scale_loss = [this](const torch::Tensor& loss) { return scale(loss); };
    scaler.scaled_count = [this] { return scaled_; };
    scaler.finite = [this, &fused](const std::vector<torch::Tensor>& found) {
      std::vector<torch::Tensor> defined;
      for (const auto& f : found) {
        if (f.defined()) defined.push_back(f);
      }
      auto& state = states_[&fused];
      // Sharded over replicas (DataParallel::step_with), each checked only its own share.
      state.found_inf =
          reduced(std::move(defined), detail::FusedStepAccess::state(fused).shard_found_inf);
      TORCH_CHECK(!state.found_inf.empty(),
                  "stagewise::amp::GradScaler::step: no inf checks were recorded for this fused "
                  "step: none of its parameters got a gradient in the closure's backward");
      state.stage = Stage::stepped;
      return !any_found(state.found_inf);
    };
    detail::TwoPass how;
    how.clip = clip;
    how.max_norm = max_norm;
    how.norm_type = norm_type;
    how.gather = gather;
    how.scaler = &scaler;
    how.who = clip ? "stagewise::optim::clip_grad_norm_step" : "stagewise::amp::GradScaler::step";
    return detail::two_pass_step(fused, closure, how);
  }

  void next_step() {
    states_.clear();
    reduction_ = nullptr;
  }

  GradScalerOptions options_;
  double init_scale_ = options_.init_scale();
  std::int64_t init_tracker_ = 0;
  torch::Tensor scale_;           // float, one element; made by the first scale()
  torch::Tensor growth_tracker_;  // int, one element, beside it
  std::map<const void*, OptimizerState> states_;  // this step's, by optimizer (or fused step)
  std::int64_t scaled_ = 0;                       // losses scaled so far
  detail::FoundInfReduction reduction_;           // this step's, over several processes
};

/// `torch::save(scaler, path)`: see `GradScaler::save`.
inline torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                   const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

/// `torch::load(scaler, path)`: see `GradScaler::load`.
inline torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                                  GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace amp

namespace detail {

// What the pipes and the clip use of a GradScaler: the scale to multiply each micro-batch's loss
// by (made on `device` if there is none yet; counted as a scaled loss), the reduction that makes
// this step's found-inf checks job-wide, its clipped two passes, and whether a fused step's two
// passes are running and under which scaler.
struct GradScalerAccess {
  static torch::Tensor loss_scale(amp::GradScaler& scaler, const c10::Device& device) {
    ++scaler.scaled_;
    return scaler.scale_on(device);
  }
  static void reduce_with(amp::GradScaler& scaler, FoundInfReduction reduction) {
    scaler.reduction_ = std::move(reduction);
  }
  template <class F>
  static optim::ClipStepResult clip(amp::GradScaler& scaler, optim::FusedStep& fused, F& closure,
                                    double max_norm, double norm_type,
                                    const optim::NormGather& gather) {
    return scaler.passes(fused, closure, true, max_norm, norm_type, gather);
  }
  static const void* owner_of_passes(optim::FusedStep& fused) {
    const auto& shared = FusedStepAccess::state(fused).shared;
    return shared.scaled != nullptr ? shared.scaled->owner : nullptr;
  }
  static bool in_passes(optim::FusedStep& fused) {
    return FusedStepAccess::state(fused).shared.in_passes;
  }
};

}  // namespace detail

namespace optim {

/// `clip_grad_norm_step` under a GradScaler (fp16): the first pass unscales every gradient,
/// checks it for inf/NaN and takes its norm; the update pass, only if the whole step is finite,
/// unscales, clips and steps every parameter; otherwise no parameter changes and `stepped` is
/// false. Bit-identical to `scaler.scale(loss).backward(); scaler.unscale_(optimizer);
/// clip_grad_norm_(...); scaler.step(optimizer)` with the unfused optimizer. Call
/// `scaler.update()` after it. A disabled scaler clips as without it.
///   auto r = sw::optim::clip_grad_norm_step(fused, [&] { return loss_fn(model(x), y); }, 1.0,
///                                           scaler);
///   scaler.update();
template <loss_closure F>
ClipStepResult clip_grad_norm_step(FusedStep& fused, F&& closure, double max_norm,
                                   amp::GradScaler& scaler, double norm_type = 2.0,
                                   const NormGather& gather = nullptr) {
  if (!scaler.is_enabled()) return clip_grad_norm_step(fused, closure, max_norm, norm_type, gather);
  return detail::GradScalerAccess::clip(scaler, fused, closure, max_norm, norm_type, gather);
}

}  // namespace optim
}  // namespace stagewise
