#pragma once

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/detail/memory_planner.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// What one micro-batch costs a stage in memory, for `plan_memory`: `activations`, what its
/// forward keeps for its backward (`profile_sizes`), and `kept`, what it keeps when checkpointed
/// (its input: the boundary), measured on one micro-batch (`profile_stage_memory`).
struct StageMemory {
  double activations = 0.0;
  double kept = 0.0;
};

/// The plan `plan_memory` chose: per stage its checkpoint mode and whether it offloads, the
/// cells it offloads, and per worker the predicted peak of activation bytes, with the simulated
/// step time. Print it with `to_string()`.
struct MemoryPlan {
  std::int64_t budget = 0;  ///< bytes per stage
  std::string schedule;     ///< the schedule it was planned for
  int micro_batches = 0;
  std::vector<Checkpoint> checkpoints;  ///< per stage
  std::vector<bool> offload_stages;     ///< per stage: whether its checkpointed cells may offload
  bool offload = false;                 ///< whether any cell is offloaded
  std::vector<Cell> offloaded;          ///< (micro-batch, stage) cells moved to the host
  std::vector<double> predicted_peak;   ///< per worker, bytes
  double step_time = 0.0;               ///< simulated, in the costs' unit
  std::vector<std::string> considered;  ///< every candidate, with its time and peak

  /// Per stage: the mode, the cells it offloads, the predicted peak (per worker when a worker
  /// runs several stages); then the candidates.
  std::string to_string() const {
    std::ostringstream out;
    out << "memory plan for " << schedule << ", " << micro_batches << " micro-batches, budget "
        << budget << " bytes per stage: " << (offload ? "offload" : "no offload") << ", step "
        << step_time << "\n";
    const bool per_stage = predicted_peak.size() == checkpoints.size();
    for (std::size_t j = 0; j < checkpoints.size(); ++j) {
      int moved = 0;
      for (const auto& c : offloaded) moved += c.stage == static_cast<int>(j);
      out << "  stage " << j << ": checkpoint " << ::stagewise::to_string(checkpoints[j])
          << ", offloads " << moved << " of " << micro_batches << " micro-batches";
      if (per_stage) {
        out << ", predicted peak " << static_cast<std::int64_t>(predicted_peak[j]) << " bytes";
      }
      out << "\n";
    }
    for (std::size_t w = 0; !per_stage && w < predicted_peak.size(); ++w) {
      out << "  worker " << w << ": predicted peak " << static_cast<std::int64_t>(predicted_peak[w])
          << " bytes\n";
    }
    for (const auto& c : considered) out << "  considered: " << c << "\n";
    return out.str();
  }
};

namespace detail {

// A stage's memory as the simulator counts it: what a micro-batch keeps and works with.
inline std::vector<CellBytes> cell_bytes_of(const std::vector<StageMemory>& stages) {
  std::vector<CellBytes> bytes;
  for (const auto& s : stages) {
    bytes.push_back({.forward = s.activations,
                     .input_grad = s.activations,
                     .working = s.activations,
                     .weight_working = s.activations,
                     .kept = s.kept});
  }
  return bytes;
}

}  // namespace detail

/// Picks, per stage, the checkpoint mode and offload choice for `sched` whose predicted activation
/// peak (`peak_bytes` on the plan, per worker from `stages`: a backward's working memory taken as
/// its activations) is at most `budget` bytes on every worker, fastest first: every stage starts
/// at never, and each stage of a worker over the budget moves to its next choice (never,
/// except_last, except_last with offload, always, always with offload; offloads only with
/// `may_offload`, and not on stages `copies.stages` excludes, by default the first) until all fit.
/// The same mode on every stage is considered too, and the fastest plan that fits wins (ties go to
/// the one that moves fewer bytes). When none fits, fails naming the smallest budget that would.
///   auto p = stagewise::schedule::plan_memory(any_schedule("1f1b", one_f_one_b{}), 8,
///                                             {{4e6, 5e5}, {4e6, 5e5}}, 6'000'000);
///   p.checkpoints;  // e.g. {except_last, never}: 1F1B's last stage holds one micro-batch
inline MemoryPlan plan_memory(const any_schedule& sched, int micro_batches,
                              const std::vector<StageMemory>& stages, std::int64_t budget,
                              bool may_offload = true, const OffloadCosts& copies = {}) {
  const int n = static_cast<int>(stages.size());
  TORCH_CHECK(n > 0, "stagewise::schedule::plan_memory: give the memory of each stage");
  TORCH_CHECK(budget > 0, "stagewise::schedule::plan_memory: the budget is ", budget,
              " bytes; give a positive number of bytes per stage");
  const std::vector<bool> allowed = detail::offload_allowed(n, may_offload, copies);
  const auto bytes = detail::cell_bytes_of(stages);
  detail::MemoryPlanner planner(sched, micro_batches, n, static_cast<double>(budget), copies,
                                [&](const Plan& p) {
                                  return detail::PlanWeight{peak_bytes(p, bytes),
                                                            simulate(p, copies.costs).makespan(),
                                                            {}};
                                });
  const auto ladder = detail::choice_ladder(allowed);
  planner.raise_per_stage(ladder);
  planner.try_uniform(allowed);
  if (!planner.best()) planner.raise_together(ladder);
  const auto& best = planner.best();
  TORCH_CHECK(best.has_value(), "stagewise::PipeOptions().memory_budget: no plan of ",
              sched.name(), " with ", micro_batches, " micro-batches fits ", budget,
              " bytes of activations per stage; the smallest budget that fits is ",
              static_cast<std::int64_t>(std::ceil(planner.smallest_peak())),
              " bytes. Give at least that, or more micro-batches (smaller ones)",
              may_offload ? "" : ", or a store to offload to");
  MemoryPlan out;
  out.budget = budget;
  out.schedule = sched.name();
  out.micro_batches = micro_batches;
  for (const auto& c : best->choices) {
    out.checkpoints.push_back(c.mode);
    out.offload_stages.push_back(c.offload);
  }
  out.offloaded = offloaded(best->plan);
  out.offload = !out.offloaded.empty();
  out.predicted_peak = best->weight.peaks;
  out.step_time = best->weight.time;
  out.considered = planner.take_considered();
  return out;
}

}  // namespace stagewise::schedule
