#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/verify.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// A verified schedule laid out for running: each worker's actions in order, with a recompute R
/// before the first backward (B or I) of every checkpointed cell whose R the schedule did not
/// place itself, and the worker of every stage. The executor and the simulator both run a Plan,
/// so what is simulated is what runs.
///   auto p = stagewise::schedule::plan(stagewise::schedule::one_f_one_b{}, 4, 8);
///   p.programs[0];   // stage 0's actions: F0@0 F1@0 F2@0 F3@0 B0@0 ...
///   p.worker_of(3);  // 3
struct Plan {
  int stages = 0;
  int micro_batches = 0;
  int workers = 0;
  std::vector<std::vector<Action>> programs;  ///< per worker, in order
  /// The worker of each stage (empty: stage k on worker k % workers).
  std::vector<int> placement;

  /// The worker that runs `stage`: `placement[stage]` (k % K for one stage per worker and for
  /// interleaved schedules; w and 2K-1-w on worker w for the V-shaped ones).
  int worker_of(int stage) const {
    return placement.empty() ? stage % workers : placement[static_cast<std::size_t>(stage)];
  }
  /// The stages worker `w` runs, in ascending order.
  std::vector<int> stages_of(int w) const {
    std::vector<int> out;
    for (int k = 0; k < stages; ++k) {
      if (worker_of(k) == w) out.push_back(k);
    }
    return out;
  }
  friend bool operator==(const Plan&, const Plan&) = default;
  /// Number of actions, recomputes included.
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& p : programs) n += p.size();
    return n;
  }
};

namespace detail {

// Lays verified actions out per worker. A checkpointed cell (micro < checkpointed[stage]) without
// an R from the schedule gets one right before its first B or I; an R on a cell that is not
// checkpointed is an error: such a cell kept its activations, so there is nothing to rebuild.
inline Plan lay_out(const std::vector<Action>& actions, int stages, int micro_batches,
                    std::vector<int> placement, int workers, const std::vector<int>& checkpointed) {
  TORCH_CHECK(static_cast<int>(checkpointed.size()) == stages, "stagewise::schedule::plan: ",
              checkpointed.size(), " checkpointed counts for ", stages,
              " stages; give one per stage");
  Plan p{stages, micro_batches, workers,
         std::vector<std::vector<Action>>(static_cast<std::size_t>(workers)), std::move(placement)};
  auto cell = [&](const Action& a) {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(micro_batches) +
           static_cast<std::size_t>(a.micro);
  };
  auto stop = [&](const Action& a) { return checkpointed[static_cast<std::size_t>(a.stage)]; };
  std::vector<char> recomputed(
      static_cast<std::size_t>(stages) * static_cast<std::size_t>(micro_batches), 0);
  for (std::size_t k = 0; k < actions.size(); ++k) {
    const Action& a = actions[k];
    TORCH_CHECK(a.kind != ActionKind::offload || a.micro < stop(a),
                "stagewise::schedule::plan: ", at(a, k), " offloads micro-batch ", a.micro,
                ", which is not checkpointed; only a checkpointed cell keeps no more than its "
                "inputs, which is what an offload moves. Remove the O (and its L), or checkpoint "
                "that micro-batch (Checkpoint::always)");
    if (a.kind != ActionKind::recompute) continue;
    TORCH_CHECK(a.micro < stop(a), "stagewise::schedule::plan: ", at(a, k),
                " recomputes micro-batch ", a.micro, ", which is not checkpointed (",
                stop(a) == 0 ? std::string("no micro-batch is")
                             : "micro-batches 0.." + std::to_string(stop(a) - 1) + " are",
                stages > 1 ? " on stage " + std::to_string(a.stage) : std::string(),
                "); a cell that is not checkpointed keeps its activations, so there is nothing to "
                "recompute. Remove the R, or checkpoint that micro-batch (Checkpoint::always)");
    recomputed[cell(a)] = 1;
  }
  for (const auto& a : actions) {
    auto& program = p.programs[static_cast<std::size_t>(p.worker_of(a.stage))];
    const bool needs_graph = a.kind == ActionKind::backward || a.kind == ActionKind::input_grad;
    auto& done = recomputed[cell(a)];
    if (needs_graph && a.micro < stop(a) && !done) {
      // The worker runs R as soon as its previous action is done, so the recompute overlaps with
      // the later stages' backward instead of waiting for the gradient.
      program.push_back({a.stage, ActionKind::recompute, a.micro});
      done = 1;
    }
    program.push_back(a);
  }
  return p;
}

}  // namespace detail

/// What is wrong with a plan (one built by `plan` and then rewritten, e.g. by `offload`), or
/// nothing: the rules of `check` on its actions, each worker's in its order, and an offload O only
/// on a cell with a recompute R (a checkpointed cell, which keeps only its inputs).
///   if (auto problem = stagewise::schedule::check(p)) std::cerr << *problem;
inline std::optional<std::string> check(const Plan& p) {
  std::vector<Action> actions;
  for (const auto& program : p.programs)
    actions.insert(actions.end(), program.begin(), program.end());
  std::vector<int> placement;
  for (int k = 0; k < p.stages; ++k) placement.push_back(p.worker_of(k));
  if (auto problem =
          detail::first_problem(actions, p.stages, p.micro_batches, placement, p.workers)) {
    return problem;
  }
  std::vector<char> recomputed(actions.size() > 0 ? static_cast<std::size_t>(p.stages) *
                                                        static_cast<std::size_t>(p.micro_batches)
                                                  : 0,
                               0);
  auto cell = [&](const Action& a) {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(p.micro_batches) +
           static_cast<std::size_t>(a.micro);
  };
  for (const auto& a : actions) {
    if (a.kind == ActionKind::recompute) recomputed[cell(a)] = 1;
  }
  for (std::size_t k = 0; k < actions.size(); ++k) {
    const Action& a = actions[k];
    if (a.kind == ActionKind::offload && !recomputed[cell(a)]) {
      return detail::at(a, k) + " offloads a cell that is not checkpointed (it has no " +
             to_string(Action{a.stage, ActionKind::recompute, a.micro}) +
             "); only a checkpointed cell keeps no more than its inputs, which is what an "
             "offload moves. Drop the O and its L, or checkpoint the cell";
    }
  }
  return std::nullopt;
}

/// Rejects an invalid plan with `check`'s message (see `check(const Plan&)`).
///   stagewise::schedule::verify(stagewise::schedule::offload(p, costs));
inline void verify(const Plan& p) {
  const auto problem = check(p);
  TORCH_CHECK(!problem, "stagewise::schedule::verify: ", problem.value_or(""));
}

/// Verifies `sched` (see `verify`) and lays it out as a Plan with the first `checkpointed[k]`
/// micro-batches of stage k checkpointed: a schedule may place their recomputes itself (yield
/// `ActionKind::recompute` between the cell's F and its first B or I, e.g. late, to hold less
/// memory); every checkpointed cell it leaves out gets an R right before its first B or I.
/// An R for a micro-batch that is not checkpointed is an error naming the action.
///   auto p = stagewise::schedule::plan(stagewise::schedule::one_f_one_b{}, 2, 8, {7, 0});
template <pipeline_schedule S>
Plan plan(const S& sched, int stages, int micro_batches, const std::vector<int>& checkpointed) {
  const int workers = workers_of(sched, stages);
  auto placement = placement_of(sched, stages);
  const auto actions = detail::collect(sched, stages, micro_batches);
  const auto problem = detail::first_problem(actions, stages, micro_batches, placement, workers);
  TORCH_CHECK(!problem, "stagewise::schedule::verify: ", problem.value_or(""));
  return detail::lay_out(actions, stages, micro_batches, std::move(placement), workers,
                         checkpointed);
}

/// `plan` with the first `checkpointed` micro-batches checkpointed on every stage.
///   auto p = stagewise::schedule::plan(stagewise::schedule::zero_bubble_v{}, 8, 8, 7);
template <pipeline_schedule S>
Plan plan(const S& sched, int stages, int micro_batches, int checkpointed = 0) {
  return plan(sched, stages, micro_batches,
              std::vector<int>(static_cast<std::size_t>(std::max(stages, 0)), checkpointed));
}

}  // namespace stagewise::schedule
