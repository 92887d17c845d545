#pragma once

// What a pipe does for PipeOptions().optimizer_offload(store, shares): the parameters of this
// process's stages whose optimizer state goes to the store (each stage's share, whole tensors,
// largest first: optim::choose_offloaded), as a runtime::OffloadedState, given to the fused step
// a train_step runs (pipe->offloaded_state() for an unfused optimizer).

#include "stagewise/optim/fused_step.hpp"
#include "stagewise/optim/state_offload.hpp"
#include "stagewise/pipe/resolved_options.hpp"
#include "stagewise/runtime/offloaded_state.hpp"
#include "stagewise/runtime/stage_runtime.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stagewise::detail {

/// The parameters of this process's stages (`stages[j]` null: another process's) whose state
/// `shares[j]` of stage j's parameter bytes keeps off the device.
inline std::vector<torch::Tensor> offloaded_parameters(
    const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
    const std::vector<double>& shares) {
  std::vector<torch::Tensor> out;
  for (std::size_t j = 0; j < stages.size() && j < shares.size(); ++j) {
    if (!stages[j] || !stages[j]->spec.module) continue;
    std::vector<torch::Tensor> params;
    std::vector<std::int64_t> bytes;
    for (const auto& p : stages[j]->spec.module->parameters()) {
      if (!p.requires_grad()) continue;
      params.push_back(p);
      bytes.push_back(static_cast<std::int64_t>(p.nbytes()));
    }
    const auto chosen = optim::choose_offloaded(bytes, shares[j]);
    for (std::size_t k = 0; k < params.size(); ++k) {
      if (chosen[k]) out.push_back(params[k]);
    }
  }
  return out;
}

/// The pipe's optimizer offload for this process's stages; an error naming the fix without one.
inline runtime::OffloadedState offloaded_state_of(
    const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
    const ResolvedPipeOptions& options, const std::string& who) {
  TORCH_CHECK(options.optimizer_store.has_value(), who,
              "::offloaded_state: the pipe keeps the optimizer's state on the device; give "
              "PipeOptions().optimizer_offload(store, share) to keep it off");
  return runtime::OffloadedState(*options.optimizer_store,
                                 offloaded_parameters(stages, options.optimizer_shares));
}

/// Gives `fused` the pipe's optimizer offload before a step, unless it has one (its own, or one
/// given before): a fused step is offloaded once.
inline void offload_fused_state(optim::FusedStep& fused,
                                const std::vector<std::unique_ptr<runtime::StageRuntime>>& stages,
                                const ResolvedPipeOptions& options) {
  if (!options.optimizer_store || fused.offloads_state()) return;
  // Of the chosen parameters, those the fused step steps (it may leave some to another).
  const auto mine = fused.parameters();
  std::vector<torch::Tensor> held;
  for (const auto& p : offloaded_parameters(stages, options.optimizer_shares)) {
    for (const auto& q : mine) {
      if (q.is_same(p)) held.push_back(p);
    }
  }
  fused.offload_state(runtime::OffloadedState(*options.optimizer_store, std::move(held)));
}

}  // namespace stagewise::detail
