#pragma once

#include "stagewise/optim/fused_step.hpp"

#include <torch/types.h>

#include <concepts>
#include <cstdint>

namespace stagewise {

/// Data parallelism as a pipe's step sees it (`PipeOver<Transport, Replicas>`): whether replicas
/// of the pipeline average their gradients, and the three points of a step where they do.
/// `OneReplica`, the default, does nothing; `distributed::Pipe` with `Options().data_parallel(d)`
/// averages over d replicas (pipe/distributed/detail/replica_gradients.hpp).
/// - `many()`: more than one replica; then the step shares the loss with the rows it averages,
///   and a fused step must be an `optim::FusedStep` (it steps on the averaged gradients);
/// - `gradients_ready(j)`: on stage j's worker, once the stage's gradients of the step are final
///   (to start reducing them);
/// - `finish(loss, rows)`: on every process after the loss arrived (this replica's mean loss over
///   its `rows` rows): completes the reductions and returns the loss to return (the global mean);
///   a failure there fails the step on every process;
/// - `step_after_reduction(fused)`: the reductions step `fused`'s parameters as their averages are
///   written (null: they stop doing so);
/// - `writes_stage_files()`: whether this process writes its stages' files in a save (replicas
///   hold the same stages: the first writes them, every replica reads them);
/// - `sharded()`: whether the replicas shard the optimizer's state (then every replica writes
///   the state of the parameters it owns in a save; the same answer on every process);
/// - `wait_parameters(stage)`: on the worker of stage `stage` (-1: every stage, on the caller)
///   before it reads its parameters: with optimizer state sharded over the replicas, until the
///   owners' updates of the last step have arrived;
/// - `own(fused)`: marks which of `fused`'s parameters this replica keeps optimizer state for
///   (sharded: the ones it owns);
/// - `weight_pass(stage, begin)`: on stage `stage`'s worker right before (`begin`) and after
///   each action computing its weight gradients (to reduce each micro-batch's as it arrives).
template <class R>
concept pipe_replicas = requires(R& r, const R& cr, int stage, const torch::Tensor& loss,
                                 std::int64_t rows, optim::FusedStep* fused) {
  { cr.many() } -> std::same_as<bool>;
  r.gradients_ready(stage);
  { r.finish(loss, rows) } -> std::same_as<torch::Tensor>;
  r.step_after_reduction(fused);
  { cr.writes_stage_files() } -> std::same_as<bool>;
  { cr.sharded() } -> std::same_as<bool>;
  r.wait_parameters(stage);
  r.own(*fused);
  r.weight_pass(stage, true);
};

/// One replica: nothing to average.
struct OneReplica {
  bool many() const { return false; }
  void gradients_ready(int /*stage*/) {}
  torch::Tensor finish(const torch::Tensor& loss, std::int64_t /*rows*/) { return loss; }
  void step_after_reduction(optim::FusedStep* /*fused*/) {}
  bool writes_stage_files() const { return true; }
  bool sharded() const { return false; }
  void wait_parameters(int /*stage*/) {}
  void own(optim::FusedStep& /*fused*/) {}
  void weight_pass(int /*stage*/, bool /*begin*/) {}
};

static_assert(pipe_replicas<OneReplica>);

}  // namespace stagewise
