#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/plan/detail/pipeline_planner.hpp"
#include "stagewise/plan/detail/rank_factorisations.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/plan/plan_options.hpp"
#include "stagewise/runtime/cell_runs.hpp"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

namespace stagewise {

/// The fastest pipeline for `model` on `batch` (one mini-batch: a tensor or a tuple, rows along
/// dimension 0), trained on `target` with `loss_fn` as `train_step` is, that fits
/// `options.memory_per_worker()` bytes on each of `options.workers()` workers, counting everything a worker holds: its stages' parameters, their gradients, the
/// optimizer's state, the activations its cells keep across the schedule, and its largest
/// action's working memory. It weighs every micro-batch count (the divisors of the batch's rows),
/// every built-in schedule (one stage per worker, or two for the V-shaped and interleaved ones),
/// two splits (the exact min-max split of the layers' profiled times, and of their sizes), each
/// stage's checkpoint mode and offload (with `options.store()`), and the optimizer step fused
/// into backward or not; each candidate is planned and simulated once on costs profiled on
/// copies of the model (`profile_stages`). Returns the fastest that fits (or, with
/// `prefer(PlanFor::memory)`, the smallest), with `report()`. When nothing fits, the error names
/// the smallest cap that would, and what else would help. The model is left as it was.
///   auto plan = sw::plan_pipeline(model, x, y, loss_fn,
///                                 sw::PlanOptions().workers(4).memory_per_worker(6LL << 30));
///   auto pipe = sw::Pipe(model, plan);
///   pipe->train_step(x, y, loss_fn);           // the planned schedule
/// With `PlanOptions().ranks(N)` it plans a distributed job instead: every factorisation of the
/// N ranks into K ranks per pipeline x d replicas (and their sharding), the replicas' gradient
/// exchange costed from `link`; build the plan with `distributed::Pipe(model, plan)` on every
/// rank (see docs/distributed.md, "Plan for the ranks you have").
///   auto plan = sw::plan_pipeline(model, x, y, loss_fn, sw::PlanOptions().ranks(4)
///                                     .memory_per_worker(cap).link(sw::distributed::measure_link(job)));
inline PipelinePlan plan_pipeline(const torch::nn::Sequential& model, const Batch& batch,
                                  const torch::Tensor& target, const runtime::loss_fn_t& loss_fn,
                                  const PlanOptions& options) {
  if (options.ranks() > 0) return detail::plan_for_ranks(model, batch, target, loss_fn, options);
  detail::PipelinePlanner planner(model, batch, target, loss_fn, options);
  for (int m : detail::micro_batch_counts(options, batch[0].size(0))) {
    planner.weigh_micro_batches(m);
  }
  return planner.plan();
}

/// plan_pipeline without the loss: the last stage is profiled back-propagating gradients of ones
/// from its output, so what the loss keeps and makes (e.g. a cross entropy's log-probabilities,
/// the size of the output) is not counted; give the target and the loss to count it.
inline PipelinePlan plan_pipeline(const torch::nn::Sequential& model, const Batch& batch,
                                  const PlanOptions& options) {
  return plan_pipeline(model, batch, torch::Tensor(), nullptr, options);
}

}  // namespace stagewise
