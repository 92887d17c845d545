#pragma once

// plan_pipeline's search for one (schedule, micro-batch count, split, fused or not): each stage's
// checkpoint mode and offload choice, the fastest (or smallest) whose predicted peak fits the cap
// on every worker, on profiled costs (stage/stage_costs.hpp), the simulator's clock and
// schedule::worker_memory. The ladder is schedule::plan_memory's: every stage starts at never;
// the stages of a worker over the cap move to their next choice (never, except_last, except_last
// + offload, always, always + offload); the same choice on every stage is weighed too.

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/schedule/any_schedule.hpp"
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

struct PlanChoice {
  Checkpoint mode = Checkpoint::never;
  bool offload = false;
  friend bool operator==(const PlanChoice&, const PlanChoice&) = default;
};

// What one setting of the stages' choices gives.
struct Weighed {
  std::vector<PlanChoice> choices;
  std::vector<schedule::WorkerMemory> memory;
  double peak = 0;
  double seconds = 0;
  bool moves = false;  // offloads something
};

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
  double seconds = schedule::simulate(plan, cost).makespan();
  if (!in.fused) {
    for (double s : in.step_seconds) seconds += s;
  }
  return seconds;
}

// The cells' bytes for `plan`: a split backward's where the schedule splits (it has I actions).
inline std::vector<schedule::CellBytes> cells_of(const schedule::Plan& plan,
                                                 const std::vector<StageCosts>& costs) {
  bool split = false;
  for (const auto& program : plan.programs) {
    for (const auto& a : program) split = split || a.kind == schedule::ActionKind::input_grad;
  }
  std::vector<schedule::CellBytes> out;
  for (const auto& c : costs) out.push_back(split ? c.split : c.whole);
  return out;
}

inline Weighed weigh(const SearchInput& in, std::vector<PlanChoice> choices,
                     schedule::PlanCache& plans) {
  std::vector<int> stops;
  schedule::OffloadCosts copies;
  copies.round_trips = 3.0;
  bool moves = false;
  const auto& costs = *in.costs;
  double forward = 0, copy = 0;
  for (int j = 0; j < in.stages; ++j) {
    const auto& c = choices[static_cast<std::size_t>(j)];
    stops.push_back(static_cast<int>(checkpoint_stop(c.mode, in.micro_batches, true)));
    copies.stages.push_back(c.offload);
    moves = moves || (c.offload && stops.back() > 0);
    forward += costs[static_cast<std::size_t>(j)].forward;
    copy += costs[static_cast<std::size_t>(j)].input_bytes / in.store_speed;
  }
  // The offload pass weighs gaps on a clock where a forward takes 1.
  copies.costs.offload = forward > 0 ? copy / forward : 0.0;
  const auto plan = plans.get(*in.sched, in.stages, in.micro_batches, stops, moves ? &copies : nullptr);
  Weighed w{std::move(choices), {}, 0.0, 0.0, moves};
  w.memory = schedule::worker_memory(*plan, cells_of(*plan, costs), in.state, in.fused);
  for (const auto& m : w.memory) w.peak = std::max(w.peak, m.peak);
  w.seconds = step_seconds(*plan, in);
  return w;
}

inline std::vector<std::vector<PlanChoice>> ladders(int stages, bool may_offload) {
  std::vector<std::vector<PlanChoice>> out(static_cast<std::size_t>(stages));
  for (int j = 0; j < stages; ++j) {
    const bool off = may_offload && j > 0;  // the caller's batch holds stage 0's inputs anyway
    auto& l = out[static_cast<std::size_t>(j)];
    l.push_back({Checkpoint::never, false});
    l.push_back({Checkpoint::except_last, false});
    if (off) l.push_back({Checkpoint::except_last, true});
    l.push_back({Checkpoint::always, false});
    if (off) l.push_back({Checkpoint::always, true});
  }
  return out;
}

// The best setting of the stages' choices for `in`: the fastest that fits (or, `for_memory`, the
// smallest that fits); when none fits, the smallest.
inline Weighed search_choices(const SearchInput& in, bool for_memory, schedule::PlanCache& plans) {
  const auto ladder = ladders(in.stages, in.may_offload);
  std::optional<Weighed> best, smallest;
  auto better = [&](const Weighed& a, const Weighed& b) {
    if (for_memory && a.peak != b.peak) return a.peak < b.peak;
    if (a.seconds != b.seconds) return a.seconds < b.seconds;
    return !a.moves && b.moves;
  };
  auto offer = [&](Weighed w) {
    if (!smallest || w.peak < smallest->peak) smallest = w;
    if (w.peak <= in.cap && (!best || better(w, *best))) best = std::move(w);
  };
  std::set<std::vector<int>> tried;
  auto key = [&](const std::vector<std::size_t>& level) {
    return std::vector<int>(level.begin(), level.end());
  };
  std::vector<std::size_t> level(static_cast<std::size_t>(in.stages), 0);
  for (;;) {
    std::vector<PlanChoice> choices;
    for (int j = 0; j < in.stages; ++j) {
      choices.push_back(ladder[static_cast<std::size_t>(j)][level[static_cast<std::size_t>(j)]]);
    }
    tried.insert(key(level));
    Weighed w = weigh(in, std::move(choices), plans);
    bool raised = false;
    const auto& plan = *plans.get(*in.sched, in.stages, in.micro_batches,
                                  std::vector<int>(static_cast<std::size_t>(in.stages), 0));
    for (int wk = 0; wk < plan.workers; ++wk) {
      if (w.memory[static_cast<std::size_t>(wk)].peak <= in.cap) continue;
      for (int j : plan.stages_of(wk)) {
        auto& at = level[static_cast<std::size_t>(j)];
        if (at + 1 < ladder[static_cast<std::size_t>(j)].size()) {
          ++at;
          raised = true;
        }
      }
    }
    const bool fits = w.peak <= in.cap;
    offer(std::move(w));
    if ((fits && !for_memory) || !raised) break;
  }
  // The same choice on every stage (a stage without the offload rungs, stage 0 or without a
  // store, takes the same mode without offload).
  for (const PlanChoice want : {PlanChoice{Checkpoint::never, false},
                                PlanChoice{Checkpoint::except_last, false},
                                PlanChoice{Checkpoint::except_last, true},
                                PlanChoice{Checkpoint::always, false},
                                PlanChoice{Checkpoint::always, true}}) {
    if (want.offload && !in.may_offload) continue;
    std::vector<std::size_t> uniform;
    for (int j = 0; j < in.stages; ++j) {
      const auto& l = ladder[static_cast<std::size_t>(j)];
      std::size_t at = 0;
      for (std::size_t r = 0; r < l.size(); ++r) {
        if (l[r] == want || (l[r].mode == want.mode && !l[r].offload && at == 0)) at = r;
      }
      uniform.push_back(at);
    }
    if (!tried.insert(key(uniform)).second) continue;
    std::vector<PlanChoice> choices;
    for (int j = 0; j < in.stages; ++j) {
      choices.push_back(ladder[static_cast<std::size_t>(j)][uniform[static_cast<std::size_t>(j)]]);
    }
    offer(weigh(in, std::move(choices), plans));
  }
  return best ? *best : *smallest;
}

}  // namespace stagewise::detail
