#pragma once

// Where data-parallel replicas of a pipeline reduce each stage's gradients, derived from the plan,
// and why that cannot deadlock with the pipeline's own messages.
//
// Each stage's gradients of a step are final after the stage's last gradient-producing action
// (its last B, or its last W under a split backward), on the stage's worker. There the worker
// starts the stage's reduction over the stage's replicas and goes on without waiting (the
// reduction runs beside the worker); every reduction is waited for only after the worker's whole
// program. So a reduction adds no wait to any worker's program: the pipeline's messages are as
// deadlock-free as `verify_comms` proves them for one replica, every worker reaches the end of
// its program, and there each waits for reductions that every replica started, in the same order
// (the order of the reduction points in the worker's program, the same in every replica, which
// is what c10d's collectives need: they match by order).

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/comms.hpp"
#include "stagewise/schedule/plan.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::schedule {

/// A stage's reduction point: on worker `worker`, right after action `after` (an index into the
/// worker's program), stage `stage`'s gradients of the step are final.
struct ReductionPoint {
  int stage = 0;
  int worker = 0;
  std::size_t after = 0;
  friend bool operator==(const ReductionPoint&, const ReductionPoint&) = default;
};

/// Every worker's reduction points, in the order its program reaches them: after each stage's
/// last B or W. A stage without any B or W (no backward) has none.
///   auto r = stagewise::schedule::reductions(plan(one_f_one_b{}, 2, 4));
///   r[1][0];  // {stage 1, worker 1, after B3@1, the last action of worker 1}
inline std::vector<std::vector<ReductionPoint>> reductions(const Plan& plan) {
  std::vector<std::vector<ReductionPoint>> out(static_cast<std::size_t>(plan.workers));
  for (std::size_t w = 0; w < plan.programs.size(); ++w) {
    const auto& program = plan.programs[w];
    std::vector<std::size_t> last(static_cast<std::size_t>(plan.stages), program.size());
    for (std::size_t k = 0; k < program.size(); ++k) {
      const auto kind = program[k].kind;
      if (kind == ActionKind::backward || kind == ActionKind::weight_grad) {
        last[static_cast<std::size_t>(program[k].stage)] = k;
      }
    }
    for (std::size_t k = 0; k < program.size(); ++k) {
      const int j = program[k].stage;
      if (last[static_cast<std::size_t>(j)] == k) {
        out[w].push_back({j, static_cast<int>(w), k});
      }
    }
  }
  return out;
}

/// What would make data-parallel replicas of `plan` reduce a stage's gradients before they are
/// final, or nothing: a stage whose B or W actions run on two workers (neither worker's point
/// has them all), or a stage without one B or W per micro-batch (missing or repeated).
inline std::optional<std::string> check_reductions(const Plan& plan) {
  const auto points = reductions(plan);
  std::vector<int> point_of(static_cast<std::size_t>(plan.stages), -1);  // its worker
  for (const auto& worker : points) {
    for (const auto& p : worker) point_of[static_cast<std::size_t>(p.stage)] = p.worker;
  }
  std::vector<int> grads(static_cast<std::size_t>(plan.stages), 0);
  for (std::size_t w = 0; w < plan.programs.size(); ++w) {
    for (const auto& a : plan.programs[w]) {
      if (a.kind != ActionKind::backward && a.kind != ActionKind::weight_grad) continue;
      const auto j = static_cast<std::size_t>(a.stage);
      ++grads[j];
      if (point_of[j] != static_cast<int>(w)) {
        return "stagewise::schedule::check_reductions: stage " + std::to_string(a.stage) +
               " computes weight gradients on workers " + std::to_string(point_of[j]) + " and " +
               std::to_string(w) + " (" + to_string(a) +
               "), so no single point has its gradients final; run each stage's backward on "
               "one worker";
      }
    }
  }
  for (int j = 0; j < plan.stages; ++j) {
    if (grads[static_cast<std::size_t>(j)] != plan.micro_batches) {
      return "stagewise::schedule::check_reductions: stage " + std::to_string(j) + " has " +
             std::to_string(grads[static_cast<std::size_t>(j)]) +
             " weight-gradient actions (B or W) for " + std::to_string(plan.micro_batches) +
             " micro-batches, so its gradients are never final or counted twice; give every "
             "micro-batch one B, or one I and one W, per stage";
    }
  }
  return std::nullopt;
}

/// Rejects a plan whose data-parallel replicas could deadlock or reduce a stage's gradients
/// before they are final: `verify_comms` for the pipeline's messages, then `check_reductions`.
/// The data-parallel distributed pipe calls it on every plan before a step runs.
///   stagewise::schedule::verify_reductions(plan(zero_bubble_h1{}, 2, 4));
inline void verify_reductions(const Plan& plan, const std::vector<SkipRoute>& routes = {}) {
  verify_comms(plan, routes);
  if (auto problem = check_reductions(plan)) TORCH_CHECK(false, *problem);
}

}  // namespace stagewise::schedule
