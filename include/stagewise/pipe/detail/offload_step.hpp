#pragma once

// What a pipe does for activation offload in a training step: run the offload pass over the
// step's plan when PipeOptions().offload(...) gave a store, and open the store for the local stages
// that offload, before anything runs (so that a store that cannot work fails the step at once).

#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/cell_runs.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"

#include <cstddef>
#include <utility>
#include <vector>

namespace stagewise::detail {

/// `plan` with the offloads `options` asks for, and `step` given the store; `stages[j]` is null
/// for a stage of another process. Unchanged without a store or without checkpointed cells.
template <class Stages>
schedule::Plan with_offloads(schedule::Plan plan, const PipeOptions& options,
                             runtime::TrainStep& step, const Stages& stages) {
  bool checkpointed = false;
  for (auto stop : step.stops) checkpointed = checkpointed || stop > 0;
  if (!options.offload_store() || !checkpointed) return plan;
  schedule::OffloadCosts costs = options.offload_costs();
  if (costs.stages.empty()) {
    costs.stages.assign(static_cast<std::size_t>(plan.stages), true);
    costs.stages[0] = false;
  }
  plan = schedule::offload(plan, costs);
  std::vector<char> offloads(static_cast<std::size_t>(plan.stages), 0);
  for (const auto& program : plan.programs) {
    for (const auto& a : program) {
      if (a.kind == schedule::ActionKind::offload) offloads[static_cast<std::size_t>(a.stage)] = 1;
    }
  }
  std::vector<int> local;
  for (int j = 0; j < plan.stages; ++j) {
    if (offloads[static_cast<std::size_t>(j)] && stages[static_cast<std::size_t>(j)]) {
      local.push_back(j);
    }
  }
  step.store = *options.offload_store();
  step.store->begin_step(local);
  return plan;
}

}  // namespace stagewise::detail
