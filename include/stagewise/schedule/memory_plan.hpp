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

// Per stage, whether it may offload: with `may_offload`, the stages `copies.stages` allows, by
// default every one but the first.
inline std::vector<bool> offload_allowed(int n, bool may_offload, const OffloadCosts& copies) {
  std::vector<bool> allowed(static_cast<std::size_t>(n), may_offload);
  if (copies.stages.empty()) {
    allowed[0] = false;  // the caller's batch holds stage 0's inputs anyway
  } else {
    for (int j = 0; j < n; ++j) {
      allowed[static_cast<std::size_t>(j)] = may_offload && detail::may_offload(copies, j);
    }
  }
  return allowed;
}

// Each stage's choices, fastest first: never, except_last (+ offload), always (+ offload).
inline std::vector<std::vector<StageChoice>> choice_ladder(const std::vector<bool>& allowed) {
  std::vector<std::vector<StageChoice>> ladder(allowed.size());
  for (std::size_t j = 0; j < allowed.size(); ++j) {
    auto& l = ladder[j];
    l.push_back({Checkpoint::never, false});
    l.push_back({Checkpoint::except_last, false});
    if (allowed[j]) l.push_back({Checkpoint::except_last, true});
    l.push_back({Checkpoint::always, false});
    if (allowed[j]) l.push_back({Checkpoint::always, true});
  }
  return ladder;
}

// One plan plan_memory weighed: the stages' choices, the plan they make and its figures.
struct MemoryCandidate {
  std::vector<StageChoice> choices;
  Plan plan;
  std::vector<double> peaks;  // per worker
  double peak = 0.0;
  double time = 0.0;
  bool moves = false;  // whether any cell is offloaded
};

// plan_memory's search: evaluates candidates, remembers every one it tried, keeps the best.
class MemoryPlanner {
 public:
  MemoryPlanner(const any_schedule& sched, int micro_batches,
                const std::vector<StageMemory>& stages, std::int64_t budget,
                const OffloadCosts& copies)
      : sched_(sched),
        m_(micro_batches),
        n_(static_cast<int>(stages.size())),
        bytes_(cell_bytes_of(stages)),
        budget_(static_cast<double>(budget)),
        copies_(copies) {}

  // Plans, simulates and records the stages' `choices`.
  MemoryCandidate evaluate(std::vector<StageChoice> choices) {
    std::vector<int> stops;
    OffloadCosts costs = copies_;
    costs.stages.assign(static_cast<std::size_t>(n_), false);
    bool moves = false;
    for (int j = 0; j < n_; ++j) {
      const auto& c = choices[static_cast<std::size_t>(j)];
      stops.push_back(static_cast<int>(checkpoint_stop(c.mode, m_, true)));
      costs.stages[static_cast<std::size_t>(j)] = c.offload;
      moves = moves || (c.offload && stops.back() > 0);
    }
    const Plan base = plan(sched_, n_, m_, stops);
    MemoryCandidate k{std::move(choices), moves ? offload(base, costs) : base, {}, 0.0, 0.0, moves};
    k.peaks = peak_bytes(k.plan, bytes_);
    k.peak = *std::max_element(k.peaks.begin(), k.peaks.end());
    k.time = simulate(k.plan, costs.costs).makespan();
    tried_.insert(describe(k.choices));
    smallest_ = std::min(smallest_, k.peak);
    std::ostringstream line;
    line << describe(k.choices) << ": step " << k.time << ", peak "
         << static_cast<std::int64_t>(k.peak) << (fits(k) ? "" : " (over)");
    considered_.push_back(line.str());
    return k;
  }

  // Keeps `k` if it fits and is faster than the best so far (on a tie, if it moves nothing).
  void offer(MemoryCandidate k) {
    if (!fits(k)) return;
    if (!best_ || k.time < best_->time || (k.time == best_->time && !k.moves && best_->moves)) {
      best_ = std::move(k);
    }
  }

  // Per stage: every stage starts at its first choice; the stages of every worker over the
  // budget move one step up their ladder, until all fit or none can move.
  void raise_per_stage(const std::vector<std::vector<StageChoice>>& ladder) {
    std::vector<std::size_t> level(static_cast<std::size_t>(n_), 0);
    for (;;) {
      std::vector<StageChoice> choices;
      for (std::size_t j = 0; j < level.size(); ++j) choices.push_back(ladder[j][level[j]]);
      MemoryCandidate k = evaluate(std::move(choices));
      bool raised = false;
      for (int w = 0; w < k.plan.workers; ++w) {
        if (k.peaks[static_cast<std::size_t>(w)] <= budget_) continue;
        for (int j : k.plan.stages_of(w)) {
          auto& at = level[static_cast<std::size_t>(j)];
          if (at + 1 < ladder[static_cast<std::size_t>(j)].size()) {
            ++at;
            raised = true;
          }
        }
      }
      const bool done = fits(k) || !raised;
      offer(std::move(k));
      if (done) return;
    }
  }

  // The same choice on every stage (a uniform offload only where the stage may offload), each
  // one not tried yet.
  void try_uniform(const std::vector<bool>& allowed) {
    const bool any_offload = std::find(allowed.begin(), allowed.end(), true) != allowed.end();
    for (const StageChoice uniform : {StageChoice{Checkpoint::never, false},
                                      StageChoice{Checkpoint::except_last, false},
                                      StageChoice{Checkpoint::except_last, true},
                                      StageChoice{Checkpoint::always, false},
                                      StageChoice{Checkpoint::always, true}}) {
      if (uniform.offload && !any_offload) continue;
      std::vector<StageChoice> choices;
      for (std::size_t j = 0; j < allowed.size(); ++j) {
        choices.push_back({uniform.mode, uniform.offload && allowed[j]});
      }
      if (!tried_.contains(describe(choices))) offer(evaluate(std::move(choices)));
    }
  }

  const std::optional<MemoryCandidate>& best() const { return best_; }
  double smallest_peak() const { return smallest_; }
  std::vector<std::string> take_considered() { return std::move(considered_); }

 private:
  bool fits(const MemoryCandidate& k) const { return k.peak <= budget_; }

  const any_schedule& sched_;
  int m_;
  int n_;
  std::vector<CellBytes> bytes_;
  double budget_;
  OffloadCosts copies_;
  std::vector<std::string> considered_;
  std::set<std::string> tried_;
  double smallest_ = std::numeric_limits<double>::infinity();
  std::optional<MemoryCandidate> best_;
};

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
  detail::MemoryPlanner planner(sched, micro_batches, stages, budget, copies);
  planner.raise_per_stage(detail::choice_ladder(allowed));
  planner.try_uniform(allowed);
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
  out.predicted_peak = best->peaks;
  out.step_time = best->time;
  out.considered = planner.take_considered();
  return out;
}

}  // namespace stagewise::schedule
