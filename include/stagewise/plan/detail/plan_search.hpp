#pragma once

// plan_pipeline's search for one (schedule, micro-batch count, split, fused or not): each stage's
// checkpoint mode and offload choice, the fastest (or smallest) whose predicted peak fits the cap
// on every worker, by the search schedule::plan_memory runs (plan/detail/memory_planner.hpp),
// weighing plans on profiled costs (plan/stage_costs.hpp), the simulator's clock and
// schedule::worker_memory.

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/detail/memory_planner.hpp"
#include "stagewise/plan/detail/replica_exchange.hpp"
#include "stagewise/plan/detail/state_offload_plan.hpp"
#include "stagewise/plan/stage_costs.hpp"
#include "stagewise/plan/worker_memory.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/plan_cache.hpp"
#include "stagewise/schedule/simulate.hpp"

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
  // ranks(N): the step as the ranks run it, the replicas' gradient exchange included
  // (plan/detail/replica_exchange.hpp); `fused` is then the fused step within one replica's
  // backward, `fused_after_exchange` the fused step of replicas, as each stage's exchange ends.
  std::optional<ReplicaExchange> exchange;
  bool fused_after_exchange = false;
  // ranks(N): per stage, the seconds its input takes to arrive from the previous stage's rank
  // (charged to its F) and its output's gradient from the next one's (charged to its B or I);
  // nothing between stages of one rank. Empty: messages cost nothing (one process).
  std::vector<double> receive_input;
  std::vector<double> receive_grad;
};

// The time action `a` waits for a message from another rank (ranks(N)): an F for its input, a B
// or an I for its output's gradient; nothing between stages of one rank, or in one process.
inline double message_seconds(const schedule::Plan& plan, const SearchInput& in,
                              const schedule::Action& a) {
  if (in.receive_input.empty()) return 0.0;
  const auto j = static_cast<std::size_t>(a.stage);
  const int w = plan.worker_of(a.stage);
  if (a.kind == schedule::ActionKind::forward && a.stage > 0 && plan.worker_of(a.stage - 1) != w) {
    return in.receive_input[j];
  }
  const bool grad = a.kind == schedule::ActionKind::backward ||
                    a.kind == schedule::ActionKind::input_grad;
  if (grad && a.stage + 1 < plan.stages && plan.worker_of(a.stage + 1) != w) {
    return in.receive_grad[j];
  }
  return 0.0;
}

// `plan` simulated on the stages' profiled costs: an offload or a reload takes its bytes over the
// store's speed (on copy lanes beside the compute); with the fused step, a stage's last B or W
// also steps its parameters.
inline schedule::Simulation simulate_step(const schedule::Plan& plan, const SearchInput& in) {
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
    t += message_seconds(plan, in, a);
    if (in.fused && (a.kind == schedule::ActionKind::backward || a.kind == schedule::ActionKind::weight_grad)) {
      const auto& program = plan.programs[static_cast<std::size_t>(plan.worker_of(a.stage))];
      const int k = spans[static_cast<std::size_t>(a.stage)].last;
      if (k >= 0 && program[static_cast<std::size_t>(k)] == a) t += in.step_seconds[static_cast<std::size_t>(a.stage)];
    }
    return t;
  };
  return schedule::simulate(plan, cost);
}

// The step's time: the simulated pipeline's, without the fused step the optimizer stepping every
// parameter after it, and the host steps of offloaded optimizer state where they outlast it.
inline double step_seconds(const schedule::Simulation& sim, const schedule::Plan& plan,
                           const SearchInput& in) {
  if (in.exchange) {
    const double ranks = replica_step_seconds(sim.timeline, plan, *in.exchange, in.step_seconds,
                                              in.fused_after_exchange, in.fused);
    return with_host_steps(sim, plan, in.host_seconds, in.fused || in.fused_after_exchange, ranks);
  }
  double seconds = sim.makespan();
  if (!in.fused) {
    for (double s : in.step_seconds) seconds += s;
  }
  return with_host_steps(sim, plan, in.host_seconds, in.fused, seconds);
}

// The cells' bytes for `plan`, from each stage's profile: F's and B's from its whole backward,
// I's and W's from its split one (a plan may hold both, DualPipeV does). Where tensors live: in
// one process a stage's output is the next stage's input, one tensor made by, and charged to,
// the worker of the stage that made it for as long as either cell holds it (its bytes are
// `output`), and so is the gradient a cell sends back (`sent_grad`): a checkpointed cell keeps
// only its replay's state of its own. On separate devices each stage holds a copy of its
// input as long as its cell lives (W may keep it) and a copy of the gradient it receives from
// its backward on (W may keep it too).
inline std::vector<schedule::CellBytes> cells_of(const std::vector<StageCosts>& costs,
                                                 bool separate_devices) {
  std::vector<schedule::CellBytes> out;
  for (std::size_t j = 0; j < costs.size(); ++j) {
    const auto& c = costs[j];
    const bool last = j + 1 == costs.size();
    schedule::CellBytes b = c.whole;
    b.forward = std::max(c.whole.forward, c.split.forward);
    b.forward_working = std::max(c.whole.forward_working, c.split.forward_working);
    b.input_grad = c.split.input_grad;
    b.input_working = c.split.input_working;
    b.weight_working = c.split.weight_working;
    b.weight_reads_input = c.split.weight_reads_input;
    b.weight_reads_grad = c.split.weight_reads_grad;
    const double received = last ? 0.0 : c.output_bytes;  // the gradient of its output
    if (separate_devices) {
      const double copy = j == 0 ? 0.0 : c.input_bytes;
      b.forward += copy;
      b.working += received;
      b.input_working += received;
      b.input_grad += (b.weight_reads_input ? copy : 0.0) + (b.weight_reads_grad ? received : 0.0);
      b.kept = c.input_bytes + c.replay_bytes;
      b.sent_grad = 0.0;
      b.output = 0.0;
    } else {
      b.output = last ? 0.0 : c.output_bytes;
      b.sent_grad = std::max(c.whole.sent_grad, c.split.sent_grad);
      // Its inputs are the previous stage's output (or the caller's); what it stashes, a later
      // stage's cell holds until about its recompute.
      b.kept = c.replay_bytes + c.stash_bytes;
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
  const auto cells = cells_of(*in.costs, in.separate_devices);
  schedule::detail::MemoryPlanner planner(
      *in.sched, in.micro_batches, in.stages, in.cap, copies,
      [&](const schedule::Plan& plan) {
        schedule::detail::PlanWeight w;
        const auto sim = simulate_step(plan, in);
        w.memory = schedule::worker_memory(plan, cells, in.state, in.fused, sim.timeline);
        for (const auto& m : w.memory) w.peaks.push_back(m.peak);
        w.time = step_seconds(sim, plan, in);
        return w;
      },
      for_memory, &plans);
  const auto ladder = schedule::detail::choice_ladder(allowed);
  planner.raise_per_stage(ladder);
  planner.try_uniform(allowed);
  if (!planner.best()) planner.raise_together(ladder);
  return planner.best() ? *planner.best() : *planner.smallest();
}

}  // namespace stagewise::detail
