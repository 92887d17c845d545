#pragma once

// What a pipe built from a Sequential does with PipeOptions().memory_budget(...): profile each
// stage on the sample, plan (schedule::plan_memory), and set each stage's checkpoint mode and the
// offloads the plan chose, keeping the plan for pipe->memory_plan().

#include "stagewise/pipe/options.hpp"
#include "stagewise/schedule/memory_plan.hpp"
#include "stagewise/stage/memory_profile.hpp"
#include "stagewise/stage/partition.hpp"

#include <torch/nn/modules/container/sequential.h>

#include <utility>

namespace stagewise::detail {

inline PipeOptions with_memory_plan(const torch::nn::Sequential& seq, const balance& b,
                                    PipeOptions options) {
  if (!options.memory_budget()) return options;
  const MemoryBudget budget = *options.memory_budget();
  const auto memory = profile_stage_memory(seq, b, budget.sample);
  auto plan = schedule::plan_memory(budget.schedule, static_cast<int>(options.chunks()), memory,
                                    budget.bytes, budget.store.has_value(), budget.costs);
  options.checkpoint(plan.checkpoints);
  if (plan.offload) {
    schedule::OffloadCosts costs = budget.costs;
    costs.stages = plan.offload_stages;
    options.offload(*budget.store, costs);
  }
  options.memory_plan(std::move(plan));
  return options;
}

}  // namespace stagewise::detail
