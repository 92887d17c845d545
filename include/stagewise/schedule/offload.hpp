#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <string>
#include <vector>

namespace stagewise::schedule {

/// What the offload pass weighs: the compute costs (`Costs`, whose `offload` is the time of one
/// copy of a cell's kept inputs to the host and `reload` of the way back), how many copies the
/// forward-to-backward gap must hide for a pair to be worth it (PipeOffload: about three), and
/// which stages may offload (empty: all; e.g. not stage 0, whose inputs the caller's batch holds
/// anyway).
///   stagewise::schedule::OffloadCosts{.costs = {.offload = 0.25}}
struct OffloadCosts {
  Costs costs{.offload = 0.25};
  double round_trips = 3.0;
  std::vector<bool> stages = {};
  friend bool operator==(const OffloadCosts&, const OffloadCosts&) = default;
};

namespace detail {

inline bool may_offload(const OffloadCosts& c, int stage) {
  return c.stages.empty() || (static_cast<std::size_t>(stage) < c.stages.size() &&
                              c.stages[static_cast<std::size_t>(stage)]);
}

}  // namespace detail

/// The offload pass: `p` (a plan with recomputes, from `plan(sched, n, m, checkpointed)`) with an
/// offload O after the forward of every checkpointed cell whose forward-to-recompute gap, on the
/// simulator's clock with `c.costs`, is at least `c.round_trips` copies (`offload` + `reload`
/// times `round_trips / 2`), and its reload L placed before the last action of the worker that
/// starts by the recompute's start minus a reload minus half a backward, so that it lands about
/// half a backward before its use (and never after the cell's R). Cells whose gap is
/// short (the last micro-batches of a stage) stay on the device. The result verifies
/// (`verify(const Plan&)`); `simulate(result, c.costs)` shows its time and `peak_bytes` its
/// memory.
///   auto p = stagewise::schedule::plan(stagewise::schedule::one_f_one_b{}, 4, 8, 8);
///   auto with = stagewise::schedule::offload(p, {.costs = {.offload = 0.25}});
inline Plan offload(const Plan& p, const OffloadCosts& c) {
  TORCH_CHECK(c.round_trips >= 0.0, "stagewise::schedule::offload: round_trips is ", c.round_trips,
              "; give 0 or more (3: keep a pair only where the gap hides three copies)");
  for (const auto& program : p.programs) {
    for (const auto& a : program) {
      TORCH_CHECK(!is_copy(a.kind), "stagewise::schedule::offload: the plan already has ",
                  to_string(a), "; give the pass a plan without offloads (from schedule::plan)");
    }
  }
  const Simulation sim = simulate(p, c.costs);
  const auto cells = static_cast<std::size_t>(p.stages) * static_cast<std::size_t>(p.micro_batches);
  auto cell = [&](const Action& a) {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(p.micro_batches) +
           static_cast<std::size_t>(a.micro);
  };
  std::vector<double> forward_end(cells, -1.0);
  std::vector<double> recompute_start(cells, -1.0);
  for (const auto& t : sim.timeline.actions) {
    if (t.action.kind == ActionKind::forward) forward_end[cell(t.action)] = t.end;
    if (t.action.kind == ActionKind::recompute) recompute_start[cell(t.action)] = t.start;
  }
  // Start times of each worker's actions, in program order (the timeline is sorted stably by
  // start, and a worker's actions start in its program's order).
  std::vector<std::vector<double>> starts(p.programs.size());
  for (const auto& t : sim.timeline.actions) {
    starts[static_cast<std::size_t>(t.worker)].push_back(t.start);
  }
  const double copy = c.costs.of(ActionKind::offload);
  const double back = c.costs.of(ActionKind::reload);
  const double gap_needed = c.round_trips * (copy + back) / 2.0;
  const double half_backward = c.costs.of(ActionKind::backward) / 2.0;
  Plan out = p;
  for (std::size_t w = 0; w < p.programs.size(); ++w) {
    const auto& program = p.programs[w];
    // Per action, the reloads to issue right before it.
    std::vector<std::vector<Action>> reloads_before(program.size());
    std::vector<char> offload_after(program.size(), 0);
    for (std::size_t k = 0; k < program.size(); ++k) {
      const Action& a = program[k];
      if (a.kind != ActionKind::forward || !detail::may_offload(c, a.stage)) continue;
      const double use = recompute_start[cell(a)];
      if (use < 0.0) continue;  // not checkpointed: it keeps its whole graph
      if (use - forward_end[cell(a)] < gap_needed) continue;
      // The R's position, and the first action after the F that starts late enough.
      std::size_t r = k + 1;
      while (r < program.size() && !(program[r].kind == ActionKind::recompute &&
                                     program[r].stage == a.stage && program[r].micro == a.micro)) {
        ++r;
      }
      // Issued before the last action that starts by then: a worker reaches an action no
      // later than its start, so the reload lands by `use - half_backward`.
      const double issue = use - back - half_backward;
      std::size_t at = k + 1;
      while (at < r && starts[w][at + 1] <= issue) ++at;
      offload_after[k] = 1;
      reloads_before[at].push_back({a.stage, ActionKind::reload, a.micro});
    }
    auto& laid = out.programs[w];
    laid.clear();
    for (std::size_t k = 0; k < program.size(); ++k) {
      for (const auto& l : reloads_before[k]) laid.push_back(l);
      laid.push_back(program[k]);
      if (offload_after[k])
        laid.push_back({program[k].stage, ActionKind::offload, program[k].micro});
    }
  }
  verify(out);
  return out;
}

/// The cells `plan` offloads, as (micro-batch, stage), in each worker's order.
///   stagewise::schedule::offloaded(with).size();  // how many pairs the pass kept
inline std::vector<Cell> offloaded(const Plan& p) {
  std::vector<Cell> out;
  for (const auto& program : p.programs) {
    for (const auto& a : program) {
      if (a.kind == ActionKind::offload) out.push_back({a.micro, a.stage});
    }
  }
  return out;
}

}  // namespace stagewise::schedule
