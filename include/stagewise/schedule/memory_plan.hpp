#pragma once

#include "stagewise/core/checkpoint_mode.hpp"
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

/// The plan `plan_memory` chose: the checkpoint mode, whether (and which cells) it offloads, and
/// per stage the predicted peak of activation bytes, with the simulated step time. Print it with
/// `to_string()`.
struct MemoryPlan {
  std::int64_t budget = 0;  ///< bytes per stage
  std::string schedule;     ///< the schedule it was planned for
  int micro_batches = 0;
  Checkpoint checkpoint = Checkpoint::except_last;
  bool offload = false;
  std::vector<Cell> offloaded;          ///< (micro-batch, stage) cells moved to the host
  std::vector<double> predicted_peak;   ///< per worker, bytes
  double step_time = 0.0;               ///< simulated, in the costs' unit
  std::vector<std::string> considered;  ///< every candidate, with its time and peak

  /// Per stage: the mode, the cells it offloads, the predicted peak; then the candidates.
  std::string to_string() const {
    std::ostringstream out;
    out << "memory plan for " << schedule << ", " << micro_batches << " micro-batches, budget "
        << budget << " bytes per stage: checkpoint " << ::stagewise::to_string(checkpoint)
        << (offload ? ", offload" : ", no offload") << ", step " << step_time << "\n";
    for (std::size_t w = 0; w < predicted_peak.size(); ++w) {
      int moved = 0;
      for (const auto& c : offloaded) moved += c.stage == static_cast<int>(w);
      out << "  stage " << w << ": checkpoint " << ::stagewise::to_string(checkpoint)
          << ", offloads " << moved << " of " << micro_batches << " micro-batches, predicted peak "
          << static_cast<std::int64_t>(predicted_peak[w]) << " bytes\n";
    }
    for (const auto& c : considered) out << "  considered: " << c << "\n";
    return out.str();
  }
};

/// Picks the fastest checkpoint mode and offload choice for `sched` (one stage per worker) whose
/// predicted activation peak (`peak_bytes` on the plan, per stage from `stages`: a backward's
/// working memory taken as its activations) is at most `budget` bytes on every stage: candidates
/// never, except_last, except_last with offload, always, always with offload (ties go to the
/// earlier, which moves fewer bytes); offloads only with `may_offload`. When none fits, fails
/// naming the smallest budget that would.
///   auto p = stagewise::schedule::plan_memory(any_schedule("1f1b", one_f_one_b{}), 8,
///                                             {{4e6, 5e5}, {4e6, 5e5}}, 6'000'000);
inline MemoryPlan plan_memory(const any_schedule& sched, int micro_batches,
                              const std::vector<StageMemory>& stages, std::int64_t budget,
                              bool may_offload = true, const OffloadCosts& copies = {}) {
  const int n = static_cast<int>(stages.size());
  TORCH_CHECK(n > 0, "stagewise::schedule::plan_memory: give the memory of each stage");
  TORCH_CHECK(budget > 0, "stagewise::schedule::plan_memory: the budget is ", budget,
              " bytes; give a positive number of bytes per stage");
  std::vector<CellBytes> bytes;
  for (const auto& s : stages) {
    bytes.push_back({.forward = s.activations,
                     .input_grad = s.activations,
                     .working = s.activations,
                     .weight_working = s.activations,
                     .kept = s.kept});
  }
  OffloadCosts offload_costs = copies;
  if (offload_costs.stages.empty()) {
    offload_costs.stages.assign(static_cast<std::size_t>(n), true);
    offload_costs.stages[0] = false;  // the caller's batch holds stage 0's inputs anyway
  }
  MemoryPlan best;
  double best_time = std::numeric_limits<double>::infinity();
  double smallest = std::numeric_limits<double>::infinity();
  std::vector<std::string> considered;
  for (auto mode : {Checkpoint::never, Checkpoint::except_last, Checkpoint::always}) {
    const int stop = static_cast<int>(checkpoint_stop(mode, micro_batches, true));
    const Plan base = plan(sched, n, micro_batches, stop);
    for (bool off : {false, true}) {
      if (off && (stop == 0 || !may_offload)) continue;
      const Plan p = off ? offload(base, offload_costs) : base;
      const auto peaks = peak_bytes(p, bytes);
      const double peak = *std::max_element(peaks.begin(), peaks.end());
      const double time = simulate(p, offload_costs.costs).makespan();
      smallest = std::min(smallest, peak);
      const bool fits = peak <= static_cast<double>(budget);
      std::ostringstream line;
      line << ::stagewise::to_string(mode) << (off ? " + offload" : "") << ": step " << time
           << ", peak " << static_cast<std::int64_t>(peak) << (fits ? "" : " (over)");
      considered.push_back(line.str());
      if (fits && time < best_time) {
        best_time = time;
        best.checkpoint = mode;
        best.offload = off;
        best.offloaded = offloaded(p);
        best.predicted_peak = peaks;
        best.step_time = time;
      }
    }
  }
  TORCH_CHECK(best_time < std::numeric_limits<double>::infinity(),
              "stagewise::PipeOptions().memory_budget: no plan of ", sched.name(), " with ",
              micro_batches, " micro-batches fits ", budget,
              " bytes of activations per stage; the smallest budget that fits is ",
              static_cast<std::int64_t>(std::ceil(smallest)),
              " bytes. Give at least that, or more micro-batches (smaller ones)",
              may_offload ? "" : ", or a store to offload to");
  best.budget = budget;
  best.schedule = sched.name();
  best.micro_batches = micro_batches;
  best.considered = std::move(considered);
  return best;
}

}  // namespace stagewise::schedule
