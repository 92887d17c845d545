#pragma once

// The search both memory planners share (schedule::plan_memory for activations, plan_pipeline
// for everything a worker holds): each stage's checkpoint mode and offload choice, weighed by a
// model of a plan's per-worker peaks and step time. Every stage starts at never; the stages of a
// worker over the budget move to their next choice (never, except_last, except_last + offload,
// always, always + offload) until all fit or none can move; the same choice on every stage is
// weighed too. The fastest that fits wins (ties go to the one that moves nothing), or, planning
// for memory, the smallest.

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/worker_memory.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/plan_cache.hpp"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::schedule::detail {

// One stage's choice, in the order the planners try them: each holds less than the one before
// and costs at least as much time.
struct StageChoice {
  Checkpoint mode;
  bool offload;
  friend bool operator==(const StageChoice&, const StageChoice&) = default;
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

// What a model says of a plan: each worker's predicted peak, the step's time, and (from a model
// that knows them) each worker's bytes by what holds them.
struct PlanWeight {
  std::vector<double> peaks;
  double time = 0.0;
  std::vector<WorkerMemory> memory;
};
using PlanModel = std::function<PlanWeight(const Plan&)>;

// One setting the search weighed: the stages' choices, the plan they make and its weight.
struct MemoryCandidate {
  std::vector<StageChoice> choices;
  Plan plan;
  PlanWeight weight;
  double peak = 0.0;   // the worst worker's
  bool moves = false;  // whether any cell is offloaded
};

// The search: evaluates settings, remembers every one it tried, keeps the best.
class MemoryPlanner {
 public:
  MemoryPlanner(const any_schedule& sched, int micro_batches, int stages, double budget,
                const OffloadCosts& copies, PlanModel model, bool for_memory = false,
                PlanCache* plans = nullptr)
      : sched_(sched),
        m_(micro_batches),
        n_(stages),
        budget_(budget),
        copies_(copies),
        model_(std::move(model)),
        for_memory_(for_memory),
        plans_(plans) {}

  // Plans, weighs and records the stages' `choices`.
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
    MemoryCandidate k{std::move(choices), make_plan(stops, moves ? &costs : nullptr), {}, 0.0,
                      moves};
    k.weight = model_(k.plan);
    k.peak = *std::max_element(k.weight.peaks.begin(), k.weight.peaks.end());
    tried_.insert(describe(k.choices));
    if (!smallest_ || k.peak < smallest_->peak) smallest_ = k;
    std::ostringstream line;
    line << describe(k.choices) << ": step " << k.weight.time << ", peak "
         << static_cast<std::int64_t>(k.peak) << (fits(k) ? "" : " (over)");
    considered_.push_back(line.str());
    return k;
  }

  // Keeps `k` if it fits and is better than the best so far: faster (on a tie, one that moves
  // nothing), or, planning for memory, smaller (on a tie, faster).
  void offer(MemoryCandidate k) {
    if (!fits(k)) return;
    if (!best_ || better(k, *best_)) best_ = std::move(k);
  }

  // Per stage: every stage starts at its first choice; the stages of every worker over the
  // budget move one step up their ladder, until all fit or none can move (planning for memory,
  // on until none can move).
  void raise_per_stage(const std::vector<std::vector<StageChoice>>& ladder) {
    std::vector<std::size_t> level(static_cast<std::size_t>(n_), 0);
    for (;;) {
      std::vector<StageChoice> choices;
      for (std::size_t j = 0; j < level.size(); ++j) choices.push_back(ladder[j][level[j]]);
      MemoryCandidate k = evaluate(std::move(choices));
      bool raised = false;
      for (int w = 0; w < k.plan.workers; ++w) {
        if (!for_memory_ && k.weight.peaks[static_cast<std::size_t>(w)] <= budget_) continue;
        for (int j : k.plan.stages_of(w)) {
          auto& at = level[static_cast<std::size_t>(j)];
          if (at + 1 < ladder[static_cast<std::size_t>(j)].size()) {
            ++at;
            raised = true;
          }
        }
      }
      const bool done = (fits(k) && !for_memory_) || !raised;
      offer(std::move(k));
      if (done) return;
    }
  }

  // Every stage up its ladder together, one step at a time (each stops at its last choice),
  // each setting not tried yet: the settings raise_per_stage tries when every worker is over,
  // so a search that found none fitting weighs, at any budget, the smallest one a search at a
  // budget nothing fits finds (what a refusal names then fits when given).
  void raise_together(const std::vector<std::vector<StageChoice>>& ladder) {
    std::size_t longest = 0;
    for (const auto& l : ladder) longest = std::max(longest, l.size());
    for (std::size_t level = 0; level < longest; ++level) {
      std::vector<StageChoice> choices;
      for (const auto& l : ladder) choices.push_back(l[std::min(level, l.size() - 1)]);
      if (!tried_.contains(describe(choices))) offer(evaluate(std::move(choices)));
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
  // The setting with the smallest peak weighed (whether or not it fits).
  const std::optional<MemoryCandidate>& smallest() const { return smallest_; }
  double smallest_peak() const {
    return smallest_ ? smallest_->peak : std::numeric_limits<double>::infinity();
  }
  std::vector<std::string> take_considered() { return std::move(considered_); }

 private:
  bool fits(const MemoryCandidate& k) const { return k.peak <= budget_; }
  bool better(const MemoryCandidate& a, const MemoryCandidate& b) const {
    if (for_memory_ && a.peak != b.peak) return a.peak < b.peak;
    if (a.weight.time != b.weight.time) return a.weight.time < b.weight.time;
    return !a.moves && b.moves;
  }
  Plan make_plan(const std::vector<int>& stops, const OffloadCosts* offloads) {
    if (plans_ != nullptr) return *plans_->get(sched_, n_, m_, stops, offloads);
    Plan p = plan(sched_, n_, m_, stops);
    return offloads != nullptr ? offload(p, *offloads) : p;
  }

  const any_schedule& sched_;
  int m_;
  int n_;
  double budget_;
  OffloadCosts copies_;
  PlanModel model_;
  bool for_memory_;
  PlanCache* plans_;
  std::vector<std::string> considered_;
  std::set<std::string> tried_;
  std::optional<MemoryCandidate> best_;
  std::optional<MemoryCandidate> smallest_;
};

}  // namespace stagewise::schedule::detail
