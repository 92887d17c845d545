#pragma once

// What a pipe does for activation offload in a training step: the costs its plan is made with
// (the offload pass runs when the plan is made, PlanCache), and the store opened for the local
// stages that offload, before anything runs (so that a store that cannot work fails the step at
// once).

#include "stagewise/pipe/resolved_options.hpp"
#include "stagewise/runtime/cell_runs.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// The offload costs a step's plan is made with (`PlanCache::get`): the options' when they give
/// a store and some cell of the step is checkpointed (`stops`, per stage), else none.
inline const schedule::OffloadCosts* offload_costs_of(const ResolvedPipeOptions& options,
                                                      const std::vector<std::int64_t>& stops) {
  bool checkpointed = false;
  for (auto stop : stops) checkpointed = checkpointed || stop > 0;
  return options.offload_store && checkpointed ? &options.offload_costs : nullptr;
}

/// Gives `step` the store and opens it for this process's stages that `plan` offloads
/// (`stages[j]` is null for a stage of another process), before anything runs, so that a store
/// that cannot work fails the step at once. Nothing without a store or without offloads.
template <class Stages>
void open_offload_store(const schedule::Plan& plan, const ResolvedPipeOptions& options,
                        runtime::TrainStep& step, const Stages& stages) {
  if (!options.offload_store) return;
  std::vector<char> offloads(static_cast<std::size_t>(plan.stages), 0);
  bool any = false;
  for (const auto& program : plan.programs) {
    for (const auto& a : program) {
      if (a.kind != schedule::ActionKind::offload) continue;
      offloads[static_cast<std::size_t>(a.stage)] = 1;
      any = true;
    }
  }
  if (!any) return;
  std::vector<int> local;
  for (int j = 0; j < plan.stages; ++j) {
    if (offloads[static_cast<std::size_t>(j)] && stages[static_cast<std::size_t>(j)]) {
      local.push_back(j);
    }
  }
  step.store = *options.offload_store;
  step.store->begin_step(local);
}

}  // namespace stagewise::detail
