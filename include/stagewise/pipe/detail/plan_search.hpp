#pragma once

// plan_pipeline's search for one (schedule, micro-batch count, split, fused or not): each stage's
// checkpoint mode and offload choice, the fastest (or smallest) whose predicted peak fits the cap
// on every worker, by the search schedule::plan_memory runs (schedule/detail/memory_planner.hpp),
// weighing plans on profiled costs (stage/stage_costs.hpp), the simulator's clock and
// schedule::worker_memory.

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/pipe/detail/state_offload_plan.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/detail/memory_planner.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/plan_cache.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/worker_memory.hpp"
#include "stagewise/stage/stage_costs.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace stagewise::detail {

// The fixed part of one search: the schedule's plan inputs, the stages' costs and state.
struct SearchInput {
  const schedule::any_schedule* sched = nullptr;
  int stages = 0;
  int micro_batches = 0;
  const std::vector<StageCosts>* costs = nullptr;
  std::vector<schedule::StageState> state;  // per stage
  std::vector<double> step_seconds;         // per stage: its optimizer step
  bool fused = false;
  bool may_offload = false;
  double store_speed = 4e9;  // bytes per second
  double cap = 0;
  bool separate_devices = false;
  // The offload pass's costs (none: from the stages' forward times and the store's speed).
  std::optional<schedule::OffloadCosts> copies;
  // Per stage, the host steps and copies of its offloaded optimizer state (empty: none;
  // state_offload_plan.hpp); `step_seconds` is then the device's part of the step.
  std::vector<double> host_seconds;
};

// The simulated step time of `plan` on the stages' profiled costs: an offload or a reload takes
// its bytes over the store's speed (on copy lanes beside the compute); with the fused step, a
// stage's last B or W also steps its parameters; without, the optimizer steps every parameter
// after the pipeline.
inline double step_seconds(const schedule::Plan& plan, const SearchInput& in) {
  const auto& costs = *in.costs;
  const auto spans = schedule::detail::gradient_spans(plan);
  // simulate's cost function sees actions, not places: a cell's action is unique in its program.
  auto cost = [&](const schedule::Action& a) {
    const StageCosts& c = costs[static_cast<std::size_t>(a.stage)];
    double t = 0;
    switch (a.kind) {
      case schedule::ActionKind::forward:
      case schedule::ActionKind::recompute: t = c.forward; break;
      case schedule::ActionKind::backward: t = c.backward; break;
      case schedule::ActionKind::input_grad: t = c.input_grad; break;
      case schedule::ActionKind::weight_grad: t = c.weight_grad; break;
      case schedule::ActionKind::offload:
      case schedule::ActionKind::reload: t = c.input_bytes / in.store_speed; break;
    }
    if (in.fused && (a.kind == schedule::ActionKind::backward || a.kind == schedule::ActionKind::weight_grad)) {
      const auto& program = plan.programs[static_cast<std::size_t>(plan.worker_of(a.stage))];
      const int k = spans[static_cast<std::size_t>(a.stage)].last;
      if (k >= 0 && program[static_cast<std::size_t>(k)] == a) t += in.step_seconds[static_cast<std::size_t>(a.stage)];
    }
    return t;
  };
  const auto sim = schedule::simulate(plan, cost);
  double seconds = sim.makespan();
  if (!in.fused) {
    for (double s : in.step_seconds) seconds += s;
  }
  return with_host_steps(sim, plan, in.host_seconds, in.fused, seconds);
}

// The cells' bytes for `plan`: a split backward's where the schedule splits (it has I actions).
// What a checkpointed cell keeps, and where: in one process a stage's output is the next stage's
// input, one tensor charged to the worker that made it, so a checkpointed cell costs its worker
// its output, which the next stage holds (the last stage's loss is a scalar); on separate devices
// each stage holds a copy of its input, as long as its cell lives.
inline std::vector<schedule::CellBytes> cells_of(const schedule::Plan& plan,
                                                 const std::vector<StageCosts>& costs,
                                                 bool separate_devices) {
  bool split = false;
  for (const auto& program : plan.programs) {
    for (const auto& a : program) split = split || a.kind == schedule::ActionKind::input_grad;
  }
  std::vector<schedule::CellBytes> out;
  for (std::size_t j = 0; j < costs.size(); ++j) {
    const auto& c = costs[j];
    schedule::CellBytes b = split ? c.split : c.whole;
    if (separate_devices) {
      const double copy = j == 0 ? 0.0 : c.input_bytes;
      b.forward += copy;
      b.input_grad += copy;
      b.kept = c.input_bytes;
    } else if (j + 1 < costs.size()) {
      // One process: the gradient a cell receives is made, and counted, on the next stage's
      // worker (profile_stages counts it with the cell, as a device holding it would).
      b.forward -= c.output_bytes;
      b.input_grad -= c.output_bytes;
      b.kept = c.output_bytes;
    } else {
      b.kept = 0.0;
    }
    out.push_back(b);
  }
  return out;
}

// The offload pass's costs on a clock where a forward takes 1: a copy of a cell's inputs takes
// its bytes over the store's speed, against the stages' mean forward.
inline schedule::OffloadCosts offload_costs_for(const SearchInput& in) {
  if (in.copies) return *in.copies;
  double forward = 0, copy = 0;
  for (const auto& c : *in.costs) {
    forward += c.forward;
    copy += c.input_bytes / in.store_speed;
  }
  schedule::OffloadCosts copies;
  copies.costs.offload = forward > 0 ? copy / forward : 0.0;
  return copies;
}

// The best setting of the stages' choices for `in` (schedule::detail::MemoryPlanner, weighing
// each plan with worker_memory and the profiled clock): the fastest that fits (or, `for_memory`,
// the smallest that fits); when none fits, the smallest.
inline schedule::detail::MemoryCandidate search_choices(const SearchInput& in, bool for_memory,
                                                        schedule::PlanCache& plans) {
  const auto copies = offload_costs_for(in);
  const auto allowed = schedule::detail::offload_allowed(in.stages, in.may_offload, copies);
  schedule::detail::MemoryPlanner planner(
      *in.sched, in.micro_batches, in.stages, in.cap, copies,
      [&](const schedule::Plan& plan) {
        schedule::detail::PlanWeight w;
        w.memory = schedule::worker_memory(plan, cells_of(plan, *in.costs, in.separate_devices), in.state, in.fused);
        for (const auto& m : w.memory) w.peaks.push_back(m.peak);
        w.time = step_seconds(plan, in);
        return w;
      },
      for_memory, &plans);
  planner.raise_per_stage(schedule::detail::choice_ladder(allowed));
  planner.try_uniform(allowed);
  return planner.best() ? *planner.best() : *planner.smallest();
}

}  // namespace stagewise::detail
