#pragma once

// A pipe's steps under an amp::GradScaler (PipeOverImpl's scaler overloads): the scale each
// micro-batch's loss is multiplied by, the scaled fused step (two passes unless a clip's passes
// already run), the found-inf check summed over a pipe's processes, and the scaler's state in a
// pipe's save.

#include "stagewise/optim/fused_step.hpp"
#include "stagewise/optim/grad_scaler.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// The scaler a pipe's step scales its losses with, for the step's duration (the pipe's member
// `slot`, which run_step reads): a disabled scaler scales nothing. Over several processes it
// also makes the scaler's found-inf check of this step job-wide (`reduction`).
class ScaledBy {
 public:
  ScaledBy(amp::GradScaler*& slot, amp::GradScaler& scaler, const FoundInfReduction& reduction)
      : slot_(slot) {
    if (!scaler.is_enabled()) return;
    slot_ = &scaler;
    if (reduction) GradScalerAccess::reduce_with(scaler, reduction);
  }
  ~ScaledBy() { slot_ = nullptr; }
  ScaledBy(const ScaledBy&) = delete;
  ScaledBy& operator=(const ScaledBy&) = delete;

 private:
  amp::GradScaler*& slot_;
};

// The scale a step multiplies each micro-batch's loss by, on the last stage's device, where the
// loss is (undefined on a process without the last stage). Every process's scaler gets its scale
// here (on its first stage's device if it has none yet), as scaler.scale(loss) would give it:
// its unscale_, step and update need one.
inline torch::Tensor step_loss_scale(amp::GradScaler& scaler,
                                     const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages) {
  const bool last = stages.back() != nullptr;
  c10::Device device = torch::kCPU;
  for (const auto& s : stages) {
    if (s) {
      device = s->device;
      break;
    }
  }
  if (last) device = stages.back()->device;
  auto scale = GradScalerAccess::loss_scale(scaler, device);
  return last ? scale : torch::Tensor();
}

// A pipe's fused step under `scaler`: inside the two passes of clip_grad_norm_step (or
// GradScaler::step) with the same scaler, one pass (`run`); otherwise the scaler's own two
// passes around it, so that no parameter steps before the whole step is known finite. A disabled
// scaler runs it once, as the plain fused step.
template <class Run>
torch::Tensor scaled_fused_step(optim::FusedStep& fused, amp::GradScaler& scaler,
                                const FoundInfReduction& reduction, const std::string& where,
                                Run&& run) {
  if (!scaler.is_enabled()) return run();
  if (reduction) GradScalerAccess::reduce_with(scaler, reduction);
  if (GradScalerAccess::in_passes(fused)) {
    TORCH_CHECK(GradScalerAccess::owner_of_passes(fused) == &scaler, where,
                ": the fused step under a GradScaler runs inside the passes of a clip (or "
                "scaler.step) given ",
                GradScalerAccess::owner_of_passes(fused) ? "another GradScaler" : "no GradScaler",
                ", which would measure scaled gradients; pass this scaler to it too "
                "(pipe->clip_grad_norm_step(fused, closure, max_norm, scaler))");
    return run();
  }
  torch::Tensor loss;
  scaler.step(fused, [&] { loss = run(); });
  return loss;
}

// A pipe's GradScaler reduction over `processes` processes through the transport's `gather`
// (every process's text in rank order): every process's found-inf sum, added up; null in one
// process. (distributed::Pipe uses an all-reduce on its process group instead.)
inline FoundInfReduction gathered_found_inf(
    int processes, std::function<std::vector<std::string>(const std::string&, const std::string&)>
                       gather) {
  if (processes <= 1) return nullptr;
  return [gather = std::move(gather)](const torch::Tensor& found) {
    char mine[64];
    std::snprintf(mine, sizeof mine, "%a", found.to(torch::kCPU, torch::kDouble).item<double>());
    double sum = 0.0;
    for (const auto& text : gather("GradScaler found_inf", mine)) {
      sum += std::strtod(text.c_str(), nullptr);
    }
    return torch::full({}, sum, found.options().dtype(torch::kFloat));
  };
}

// The key of the scaler's state in a pipe save's optimizer entry.
inline constexpr const char* kScalerKey = "stagewise_grad_scaler";

// Writes `scaler`'s state beside the optimizer's in a pipe's save.
inline void save_scaler(torch::serialize::OutputArchive& optimizer,
                        const amp::GradScaler& scaler) {
  torch::serialize::OutputArchive s;
  s.write("enabled", c10::IValue(scaler.is_enabled()));
  scaler.save(s);
  optimizer.write(kScalerKey, s);
}

// Refuses, before a pipe's load changes anything, a save without a scaler's state.
inline void check_scaler_saved(torch::serialize::InputArchive& optimizer, const std::string& where,
                               const std::string& dir) {
  torch::serialize::InputArchive s;
  TORCH_CHECK(optimizer.try_read(kScalerKey, s), where, "the save in ", dir,
              " has no GradScaler state (it was saved without one); load it with load(dir, "
              "optimizer), or resume from a save made with save(dir, optimizer, scaler, step)");
}

// Loads the scaler's state saved by save_scaler.
inline void load_scaler(torch::serialize::InputArchive& optimizer, amp::GradScaler& scaler) {
  torch::serialize::InputArchive s;
  optimizer.read(kScalerKey, s);
  scaler.load(s);
}

}  // namespace stagewise::detail
