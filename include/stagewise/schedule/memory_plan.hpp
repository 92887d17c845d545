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

// One stage's choice, in the order plan_memory tries them: each holds less than the one before
// and costs at least as much time.
struct StageChoice {
  Checkpoint mode;
  bool offload;
};

inline std::string describe(const std::vector<StageChoice>& choices) {
  std::string out;
  for (std::size_t j = 0; j < choices.size(); ++j) {
    if (j > 0) out += " | ";
    out += ::stagewise::to_string(choices[j].mode);
    if (choices[j].offload) out += " + offload";
  }
  return out;
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
  using detail::StageChoice;
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
  std::vector<bool> allowed(static_cast<std::size_t>(n), may_offload);
  if (copies.stages.empty()) {
    allowed[0] = false;  // the caller's batch holds stage 0's inputs anyway
  } else {
    for (int j = 0; j < n; ++j) {
      allowed[static_cast<std::size_t>(j)] =
          may_offload && detail::may_offload(copies, j);
    }
  }
  // Each stage's choices, fastest first.
  std::vector<std::vector<StageChoice>> ladder(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j) {
    auto& l = ladder[static_cast<std::size_t>(j)];
    const bool off = allowed[static_cast<std::size_t>(j)];
    l.push_back({Checkpoint::never, false});
    l.push_back({Checkpoint::except_last, false});
    if (off) l.push_back({Checkpoint::except_last, true});
    l.push_back({Checkpoint::always, false});
    if (off) l.push_back({Checkpoint::always, true});
  }

  struct Candidate {
    std::vector<StageChoice> choices;
    Plan plan;
    std::vector<double> peaks;
    double peak = 0.0;
    double time = 0.0;
    bool moves = false;
  };
  std::vector<std::string> considered;
  std::set<std::string> tried;
  double smallest = std::numeric_limits<double>::infinity();
  auto evaluate = [&](std::vector<StageChoice> choices) {
    std::vector<int> stops;
    OffloadCosts costs = copies;
    costs.stages.assign(static_cast<std::size_t>(n), false);
    bool moves = false;
    for (int j = 0; j < n; ++j) {
      const auto& c = choices[static_cast<std::size_t>(j)];
      stops.push_back(static_cast<int>(checkpoint_stop(c.mode, micro_batches, true)));
      costs.stages[static_cast<std::size_t>(j)] = c.offload;
      moves = moves || (c.offload && stops.back() > 0);
    }
    const Plan base = plan(sched, n, micro_batches, stops);
    Candidate k{std::move(choices), moves ? offload(base, costs) : base, {}, 0.0, 0.0, moves};
    k.peaks = peak_bytes(k.plan, bytes);
    k.peak = *std::max_element(k.peaks.begin(), k.peaks.end());
    k.time = simulate(k.plan, costs.costs).makespan();
    tried.insert(detail::describe(k.choices));
    smallest = std::min(smallest, k.peak);
    std::ostringstream line;
    line << detail::describe(k.choices) << ": step " << k.time << ", peak "
         << static_cast<std::int64_t>(k.peak) << (k.peak <= static_cast<double>(budget) ? "" : " (over)");
    considered.push_back(line.str());
    return k;
  };
  std::optional<Candidate> best;
  auto offer = [&](Candidate k) {
    if (k.peak > static_cast<double>(budget)) return;
    if (!best || k.time < best->time || (k.time == best->time && !k.moves && best->moves)) {
      best = std::move(k);
    }
  };
  // Per stage: raise the stages of every worker over the budget one step at a time.
  std::vector<std::size_t> level(static_cast<std::size_t>(n), 0);
  for (;;) {
    std::vector<StageChoice> choices;
    for (int j = 0; j < n; ++j) {
      choices.push_back(ladder[static_cast<std::size_t>(j)][level[static_cast<std::size_t>(j)]]);
    }
    Candidate k = evaluate(std::move(choices));
    bool raised = false;
    for (int w = 0; w < k.plan.workers; ++w) {
      if (k.peaks[static_cast<std::size_t>(w)] <= static_cast<double>(budget)) continue;
      for (int j : k.plan.stages_of(w)) {
        auto& at = level[static_cast<std::size_t>(j)];
        if (at + 1 < ladder[static_cast<std::size_t>(j)].size()) {
          ++at;
          raised = true;
        }
      }
    }
    const bool fits = k.peak <= static_cast<double>(budget);
    offer(std::move(k));
    if (fits || !raised) break;
  }
  // The same choice on every stage (a uniform offload only where the stage may offload).
  const bool any_offload = std::find(allowed.begin(), allowed.end(), true) != allowed.end();
  for (const StageChoice uniform : {StageChoice{Checkpoint::never, false},
                                    StageChoice{Checkpoint::except_last, false},
                                    StageChoice{Checkpoint::except_last, true},
                                    StageChoice{Checkpoint::always, false},
                                    StageChoice{Checkpoint::always, true}}) {
    if (uniform.offload && !any_offload) continue;
    std::vector<StageChoice> choices;
    for (int j = 0; j < n; ++j) {
      choices.push_back({uniform.mode, uniform.offload && allowed[static_cast<std::size_t>(j)]});
    }
    if (!tried.contains(detail::describe(choices))) offer(evaluate(std::move(choices)));
  }
  TORCH_CHECK(best.has_value(), "stagewise::PipeOptions().memory_budget: no plan of ",
              sched.name(), " with ", micro_batches, " micro-batches fits ", budget,
              " bytes of activations per stage; the smallest budget that fits is ",
              static_cast<std::int64_t>(std::ceil(smallest)),
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
  out.predicted_peak = best->peaks;
  out.step_time = best->time;
  out.considered = std::move(considered);
  return out;
}

}  // namespace stagewise::schedule
