#pragma once

// The cell runs the executor's actions are made of: a cell's forward (F), its recompute (R), the
// roots its backward (B or I) differentiates, its loss; what a cell keeps between its forward and
// its backward; and what one training step shares with every worker (runtime/program_executor.hpp
// runs them in a plan's order).

#include "stagewise/core/batch.hpp"
#include "stagewise/core/detail/cell.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/detail/train_skips.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/split_backward.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/action.hpp"

#include <torch/autograd.h>
#include <torch/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::runtime {

using loss_fn_t = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

namespace detail {

struct Aborted {};  // thrown inside a worker when another one failed

// What one stage keeps for one micro-batch between its forward and its backward.
struct CellMemory {
  std::vector<torch::Tensor> leaves;  // the inputs, as leaves of this stage's graph
  bool input_atomic = true;
  std::vector<torch::Tensor> outputs;  // with their graph (empty while checkpointed)
  torch::Tensor loss;                  // last stage only
  std::optional<::stagewise::detail::CellReplay> replay;  // checkpointed cells only
  std::optional<SplitBackward> split;                     // between I and W
  std::vector<char> away_grad;  // between its O and L: whether each kept tensor required grad
};

}  // namespace detail

/// Everything one training step needs, shared by the stage workers.
struct TrainStep {
  std::vector<Batch> inputs;
  std::vector<Batch> targets;
  std::vector<double> weights;  // each micro-batch's share of the loss
  loss_fn_t loss_fn;
  /// A GradScaler's scale on the last stage's device: each micro-batch's weighted loss is
  /// multiplied by it before its backward, as `scaler.scale(loss).backward()` does (the loss
  /// returned stays unscaled); undefined: not scaled.
  torch::Tensor loss_scale;
  std::vector<int64_t> stops;  // per stage: its micro-batches below it are checkpointed
  int64_t stop_of(int stage) const {
    return stops.empty() ? 0 : stops[static_cast<std::size_t>(stage)];
  }
  bool training = true;
  std::chrono::steady_clock::time_point start;  // time zero of a recorded timeline
  std::shared_ptr<::stagewise::runtime::detail::TrainSkips> skips;  // skip connections; null: none
  /// Called on the worker with stage j once its parameters' gradients of the step are final (after
  /// the stage's last B or W), e.g. to start reducing them; null: nothing is called.
  std::function<void(int)> gradients_ready;
  /// Called on the worker with stage j before the stage's first forward of the step, e.g. to
  /// wait for parameters another process updated (sharded optimizer state); null: nothing.
  std::function<void(int)> parameters_needed;
  /// Called on the worker with stage j right before (`true`) and after (`false`) each action
  /// that computes the stage's weight gradients (B, or W under a split backward), e.g. to reduce
  /// each micro-batch's gradients as they arrive; null: nothing.
  std::function<void(int, bool)> weight_pass;
  /// Where offloads O put what a checkpointed cell keeps until its reload L; none: the plan has
  /// no O.
  std::optional<AnyStore> store;
};

namespace detail {

// loss_fn's result for micro-batch i, checked to be a scalar and weighted by the micro-batch's
// share of the rows.
inline torch::Tensor micro_batch_loss(const Batch& out, TrainStep& step, int i) {
  TORCH_CHECK(out.atomic() && step.targets[i].atomic(),
              "stagewise::train_step: the last stage must return one Tensor and the target "
              "must be one Tensor, to call loss_fn(output, target)");
  torch::Tensor loss = step.loss_fn(out.tensor(), step.targets[i].tensor());
  TORCH_CHECK(loss.defined(),
              "stagewise::train_step: loss_fn returned an undefined tensor; "
              "return the loss of the micro-batch");
  TORCH_CHECK(loss.dim() == 0, "stagewise::train_step: loss_fn returned a tensor of shape ",
              loss.sizes(),
              ", not a scalar; reduce it to the mean over the micro-batch (e.g. "
              "torch::mse_loss(out, target) with its default Reduction::Mean, or loss.mean())");
  return loss * step.weights[i];
}

// F: runs stage j on micro-batch i from `x` and keeps what its backward needs; returns the output.
inline Batch forward_cell(StageRuntime& stage, int j, int i, bool last, Batch x, TrainStep& step,
                          CellMemory& cell, torch::Tensor& total) {
  const int64_t stop = step.stop_of(j);
  const bool replay = stop > 0;
  cell.input_atomic = x.atomic();
  for (const auto& t : x) {
    const bool grad = j > 0 && (t.is_floating_point() || t.is_complex());
    cell.leaves.push_back(t.detach().requires_grad_(grad));
  }
  auto run = [&] {
    auto call = [&] {
      return stage.spec.fn(cell.input_atomic ? Batch(cell.leaves.front()) : Batch(cell.leaves));
    };
    Batch out = step.skips ? step.skips->run(j, i, call) : call();
    if (last) cell.loss = micro_batch_loss(out, step, i);
    return out;
  };
  std::optional<Batch> out;
  if (i < stop) {
    stage.rng.run(step.training, [&] {
      cell.replay =
          ::stagewise::detail::run_checkpointed(stage.device, [&] { out.emplace(run()); });
    });
  } else if (replay) {
    stage.rng.run(step.training, [&] { out.emplace(run()); });
  } else {
    out.emplace(run());
  }
  if (last) {
    auto value = cell.loss.detach();
    total = total.defined() ? total + value : value;
    if (i < stop) cell.loss = torch::Tensor();  // recomputed with grad later
  }
  if (i >= stop) cell.outputs.assign(out->begin(), out->end());
  return std::move(*out);
}

// R: re-runs a checkpointed cell with grad enabled and its forward's random numbers.
inline void recompute_cell(StageRuntime& stage, int j, int i, bool last, TrainStep& step,
                           CellMemory& cell) {
  stage.rng.run(step.training, [&] {
    // The F that checkpointed this cell has taught the section whether the stage draws. The
    // worker keeps its casts for the rest of the pass, which clears them.
    ::stagewise::detail::run_recompute(
        *cell.replay, !stage.rng.draws_nothing(step.training),
        ::stagewise::detail::RecomputeCasts::keep, [&] {
          auto call = [&] {
            return stage.spec.fn(cell.input_atomic ? Batch(cell.leaves.front())
                                                   : Batch(cell.leaves));
          };
          Batch out = step.skips ? step.skips->run(j, i, call) : call();
          if (last) cell.loss = micro_batch_loss(out, step, i);
          cell.outputs.assign(out.begin(), out.end());
        });
  });
}

// The phase an action runs, as error contexts name it.
inline Phase phase_of(schedule::ActionKind kind) {
  switch (kind) {
    case schedule::ActionKind::forward:
      return Phase::forward;
    case schedule::ActionKind::recompute:
      return Phase::recompute;
    case schedule::ActionKind::backward:
      return Phase::backward;
    case schedule::ActionKind::input_grad:
      return Phase::input_grad;
    case schedule::ActionKind::weight_grad:
      return Phase::weight_grad;
    case schedule::ActionKind::offload:
      return Phase::offload;
    case schedule::ActionKind::reload:
      return Phase::reload;
  }
  return Phase::forward;
}

// The outputs to differentiate and their gradients: the loss on the last stage, else the outputs
// that require grad and got a gradient from the next stage.
inline void backward_roots(const CellMemory& cell, bool last, const std::vector<torch::Tensor>* g,
                           std::vector<torch::Tensor>& outs, std::vector<torch::Tensor>& grads) {
  if (last) {
    outs.push_back(cell.loss);
    grads.push_back(torch::ones_like(cell.loss));
    return;
  }
  for (std::size_t k = 0; k < cell.outputs.size() && k < g->size(); ++k) {
    if (cell.outputs[k].requires_grad() && (*g)[k].defined()) {
      outs.push_back(cell.outputs[k]);
      grads.push_back((*g)[k]);
    }
  }
}

}  // namespace detail

}  // namespace stagewise::runtime
