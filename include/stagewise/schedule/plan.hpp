#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/verify.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <vector>

namespace stagewise::schedule {

/// A verified schedule laid out for running: each worker's actions in order, with a recompute R
/// inserted just before the first backward (B or I) of every checkpointed micro-batch. The
/// executor and the simulator both run a Plan, so what is simulated is what runs.
///   auto p = stagewise::schedule::plan(stagewise::schedule::one_f_one_b{}, 4, 8);
///   p.programs[0];  // stage 0's actions: F0@0 F1@0 F2@0 F3@0 B0@0 ...
struct Plan {
  int stages = 0;
  int micro_batches = 0;
  int workers = 0;
  std::vector<std::vector<Action>> programs;  ///< per worker, in order

  /// The worker that runs `stage`.
  int worker_of(int stage) const { return stage % workers; }
  /// Number of actions, recomputes included.
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& p : programs) n += p.size();
    return n;
  }
};

/// Verifies `sched` (see `verify`) and lays it out as a Plan; the first `checkpointed`
/// micro-batches get a recompute before their first backward on every stage.
template <pipeline_schedule S>
Plan plan(const S& sched, int stages, int micro_batches, int checkpointed = 0) {
  const int workers = workers_of(sched, stages);
  const auto actions = detail::collect(sched, stages, micro_batches);
  const auto problem = detail::first_problem(actions, stages, micro_batches, workers);
  TORCH_CHECK(!problem, "stagewise::schedule::verify: ", problem.value_or(""));
  Plan p{stages, micro_batches, workers,
         std::vector<std::vector<Action>>(static_cast<std::size_t>(workers))};
  std::vector<char> recomputed(
      static_cast<std::size_t>(stages) * static_cast<std::size_t>(micro_batches), 0);
  for (const auto& a : actions) {
    auto& program = p.programs[static_cast<std::size_t>(p.worker_of(a.stage))];
    const bool needs_graph = a.kind == ActionKind::backward || a.kind == ActionKind::input_grad;
    auto& done =
        recomputed[static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(micro_batches) +
                   static_cast<std::size_t>(a.micro)];
    if (needs_graph && a.micro < checkpointed && !done) {
      // The worker runs R as soon as its previous action is done, so the recompute overlaps with
      // the later stages' backward instead of waiting for the gradient.
      program.push_back({a.stage, ActionKind::recompute, a.micro});
      done = 1;
    }
    program.push_back(a);
  }
  return p;
}

}  // namespace stagewise::schedule
