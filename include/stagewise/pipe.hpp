#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/nn/convert_deferred_batch_norm.hpp"
#include "stagewise/nn/deferred_batch_norm.hpp"
#include "stagewise/pipe/detail/placed_stages.hpp"
#include "stagewise/pipe/detail/stage_devices.hpp"
#include "stagewise/pipe/detail/step.hpp"
#include "stagewise/pipe/fused_stepper.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/clock_executor.hpp"
#include "stagewise/runtime/detail/train_skips.hpp"
#include "stagewise/runtime/program_executor.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/timeline.hpp"
#include "stagewise/skip/detail/inspect.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/skip/verify.hpp"
#include "stagewise/stage/partition.hpp"
#include "stagewise/stage/stage_list.hpp"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// The pipeline itself, behind the `Pipe` holder: stages on their own worker threads, a
/// mini-batch split into micro-batches, and two ways to train.
///
/// - `forward(x)`: torchgpipe's semantics. The output is connected to autograd and the caller
///   runs backward; checkpointed cells recompute just before their gradient arrives.
/// - `train_step(x, target, loss_fn)`: forward and backward of every (micro-batch, stage) cell run
///   on the stage's worker following a schedule, so stages overlap in both directions; the
///   parameters' gradients accumulate exactly as unpipelined training on the micro-batches would.
class PipeImpl : public detail::PlacedStages {
 public:
  PipeImpl(std::vector<detail::StageSpec> specs, PipeOptions options,
           std::vector<std::shared_ptr<torch::nn::Module>> layers)
      : detail::PlacedStages("stagewise::Pipe"),
        options_(std::move(options)),
        layers_(std::move(layers)) {
    verify_ownership(specs);
    collect_deferred_batch_norms(specs);
    {
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      for (const auto& spec : specs) modules.push_back(spec.module);
      // Every stash/pop problem of the layers, collected into one message.
      skips_ = std::make_shared<const detail::SkipLayout>(detail::skip_layout_of(modules));
    }
    const auto devices = detail::place_stage_modules(specs, options_.devices(), "stagewise::Pipe",
                                                     [](std::size_t) { return true; });
    for (std::size_t k = 0; k < specs.size(); ++k) {
      if (specs[k].module) register_module("stage" + std::to_string(k), specs[k].module);
      stages_.push_back(std::make_unique<runtime::StageRuntime>(std::move(specs[k]), devices[k]));
    }
  }

  /// Runs the pipeline on one tensor; see the class comment. `x` may be on any device (each
  /// micro-batch moves to stage 0's); the output is on the last stage's device. An empty pipe
  /// returns `x`.
  torch::Tensor forward(const torch::Tensor& x) {
    Batch out = forward_batch(Batch(x));
    TORCH_CHECK(out.atomic(), "stagewise::Pipe::forward: the last stage returned ", out.size(),
                " tensors; call forward_batch to get them all");
    return out.tensor();
  }

  /// Runs the pipeline on a batch of one tensor or a tuple of tensors.
  Batch forward_batch(const Batch& input) {
    if (stages_.empty()) return input;
    if (!deferred_.empty()) begin_mini_batch(scatter(input, options_.chunks()).size());
    return runtime::run_clock_cycles(stages_, input, options_.chunks(), options_.checkpoint(),
                                     is_training(), skips_->empty() ? nullptr : skips_);
  }

  /// One training step driven by `sched` (GPipe's fill-drain by default; also
  /// `schedule::one_f_one_b`, `interleaved_one_f_one_b`, `zero_bubble_h1`, or your own coroutine):
  /// returns the loss of the whole mini-batch and leaves the parameters' gradients accumulated, as
  /// `loss_fn(model(input), target).backward()` would. `loss_fn(output, target)` must average
  /// over the rows of its micro-batch (the default reduction of LibTorch's losses); each
  /// micro-batch's loss is weighted by its share of the rows. Every tensor of `input` and `target`
  /// must have the same, positive number of rows, and `loss_fn` must return a scalar: anything
  /// else is an error naming the fix. `input` and `target` may be on any device: each
  /// micro-batch's input moves to stage 0's device and its target to the last stage's, where
  /// `loss_fn` runs; the returned loss is on the last stage's device. An exception from a stage
  /// keeps its type and text and records its stage, micro-batch and phase (`error_context`). The
  /// schedule is verified before anything runs. An interleaved schedule runs the pipe's v x K
  /// stages on the first K stages' workers (stage k on worker k % K). If `timeline` is given, it
  /// receives every action's start and end in microseconds (see `schedule::to_chrome_trace`).
  ///   sw::schedule::Timeline t;
  ///   pipe->train_step(x, y, loss_fn, sw::schedule::zero_bubble_h1{}, &t);
  template <schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           const Schedule& sched = {}, schedule::Timeline* timeline = nullptr) {
    return run_train_step(input, target, std::move(loss_fn), sched, nullptr, timeline);
  }

  /// train_step with the optimizer step fused into backward (e.g. `optim::FusedStep`): each
  /// parameter steps as soon as its stage's last micro-batch has been back-propagated, while the
  /// earlier stages are still in backward, and its gradient is freed at once. Equal, bit for bit,
  /// to train_step followed by the unfused optimizer's step (for SGD, Adam, AdamW, ...).
  ///   stagewise::optim::FusedStep fused(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  ///   auto loss = pipe->train_step(x, y, loss_fn, fused);  // no optimizer.step() needed
  template <fused_stepper Fused, schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           Fused& fused, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    return detail::with_fused_step(fused, [&](const std::function<void(int)>& before) {
      return run_train_step(input, target, std::move(loss_fn), sched, before, timeline);
    });
  }

  /// The fused train_step for one input tensor and one target tensor.
  template <fused_stepper Fused, schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, Fused& fused, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), fused, sched, timeline);
  }

 private:
  template <class Schedule>
  torch::Tensor run_train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                               const Schedule& sched, const std::function<void(int)>& before,
                               schedule::Timeline* timeline) {
    TORCH_CHECK(!stages_.empty(), "stagewise::Pipe::train_step: the pipe has no stages");
    TORCH_CHECK(torch::GradMode::is_enabled(),
                "stagewise::Pipe::train_step: grad mode is off (a NoGradGuard is active); "
                "train_step computes gradients, so call it with grad enabled, or use forward");
    detail::check_step_rows(&input, &target, "stagewise::Pipe::train_step");
    runtime::TrainStep step;
    step.inputs = scatter(input, options_.chunks());
    step.targets = scatter(target, options_.chunks());
    step.weights = detail::row_weights(step.inputs);
    step.loss_fn = std::move(loss_fn);
    step.training = is_training();
    const int m = static_cast<int>(step.inputs.size());
    step.stop = checkpoint_stop(options_.checkpoint(), m, step.training);
    const auto plan =
        schedule::plan(sched, static_cast<int>(stages_.size()), m, static_cast<int>(step.stop));
    if (!skips_->empty()) {
      step.skips = std::make_shared<runtime::detail::TrainSkips>(skips_, stages_.size(),
                                                                 static_cast<std::size_t>(m));
    }
    // Each micro-batch's input on stage 0's device and its target on the last stage's, moved
    // here on the caller's thread, after the caller's streams (the fence) and before any worker.
    runtime::StreamFence fence(stages_);
    stages_.front()->receive_from_caller(step.inputs);
    stages_.back()->receive_from_caller(step.targets);
    if (before) before(m);
    // The pipe's worker pool: plan.workers threads. In one process a plan never has more workers
    // than stages, so the pool is the stages' own threads (worker w on stage w's thread).
    TORCH_CHECK(plan.workers <= static_cast<int>(stages_.size()),
                "stagewise::Pipe::train_step: the schedule plans ", plan.workers, " workers for ",
                stages_.size(), " stages; a pipe runs at most one worker per stage");
    std::vector<Worker*> workers(static_cast<std::size_t>(plan.workers));
    for (std::size_t w = 0; w < workers.size(); ++w) workers[w] = &stages_[w]->worker;
    begin_mini_batch(step.inputs.size());
    return runtime::run_programs(stages_, plan, step, workers, timeline);
  }

 public:
  /// train_step for one input tensor and one target tensor.
  template <schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), sched, timeline);
  }

  /// Number of stages.
  std::size_t num_stages() const { return stages_.size(); }
  /// The device of stage `k`.
  torch::Device device(std::size_t k) const { return stage_at(k).device; }
  /// The options the pipe was built with.
  const PipeOptions& options() const { return options_; }
  /// Which stage stashes and which pops each skip connection (verified at construction).
  const detail::SkipLayout& skip_layout() const { return *skips_; }

  /// Number of layers: the Sequential's layers, or the stages of a typed stage list.
  std::size_t size() const { return layers_.size(); }
  /// Layer `i` of the original model.
  std::shared_ptr<torch::nn::Module> layer(std::size_t i) const {
    TORCH_CHECK_INDEX(i < layers_.size(), "stagewise::Pipe: layer index ", i,
                      " is out of range for a pipe of ", layers_.size(), " layers");
    return layers_[i];
  }
  /// The original layers, in order.
  const std::vector<std::shared_ptr<torch::nn::Module>>& layers() const { return layers_; }

  // to(device) is refused by PlacedStages: the pipe places each stage on its device.

 private:

  const runtime::StageRuntime& stage_at(std::size_t k) const {
    TORCH_CHECK_INDEX(k < stages_.size(), "stagewise::Pipe: stage index ", k,
                      " is out of range for a pipe of ", stages_.size(), " stages");
    return *stages_[k];
  }

  // Finds the DeferredBatchNorm layers of every stage; with deferred_batch_norm(true), a plain
  // batch norm left in a stage (a typed stage, or one hidden in a custom module) is an error.
  void collect_deferred_batch_norms(const std::vector<detail::StageSpec>& specs) {
    for (std::size_t k = 0; k < specs.size(); ++k) {
      const auto& module = specs[k].module;
      if (!module) continue;
      if (options_.deferred_batch_norm()) {
        detail::refuse_hidden_batch_norm(*module, "stage" + std::to_string(k));
      }
      for (const auto& m : module->modules()) {
        if (auto bn = std::dynamic_pointer_cast<DeferredBatchNormImpl>(m)) deferred_.push_back(bn);
      }
    }
  }

  // Each DeferredBatchNorm commits its running statistics after this mini-batch's last
  // micro-batch, however many the batch splits into.
  void begin_mini_batch(std::size_t micro_batches) {
    for (const auto& bn : deferred_) bn->begin_mini_batch(static_cast<int64_t>(micro_batches));
  }

  static void verify_ownership(const std::vector<detail::StageSpec>& specs) {
    std::map<const torch::nn::Module*, std::size_t> seen;
    std::map<const c10::TensorImpl*, std::size_t> owner;
    for (std::size_t k = 0; k < specs.size(); ++k) {
      if (!specs[k].module) continue;
      auto [it, fresh] = seen.emplace(specs[k].module.get(), k);
      TORCH_CHECK(fresh, "stagewise::Pipe: stages ", it->second, " and ", k,
                  " are the same module; a module may be one stage only. Use two modules.");
      for (const auto& p : specs[k].module->parameters()) {
        auto [o, fresh_param] = owner.emplace(p.unsafeGetTensorImpl(), k);
        TORCH_CHECK(fresh_param, "stagewise::Pipe: stages ", o->second, " and ", k,
                    " share a parameter; stages must own their parameters. Tie them inside one "
                    "stage instead.");
      }
    }
  }

  PipeOptions options_;
  std::shared_ptr<const detail::SkipLayout> skips_;
  std::vector<std::shared_ptr<torch::nn::Module>> layers_;
  std::vector<std::unique_ptr<runtime::StageRuntime>> stages_;
  std::vector<std::shared_ptr<DeferredBatchNormImpl>> deferred_;
};

/// A pipeline over a compile-time stage list (`Pipe<S...>`), or over a torch::nn::Sequential
/// split by a balance (`Pipe<>`). A module holder: use `pipe->forward(x)`,
/// `pipe->train_step(...)`, `pipe->parameters()`.
///   auto pipe = stagewise::Pipe(stagewise::stages(embed, blocks, head),
///                               stagewise::PipeOptions().chunks(8));
///   auto pipe2 = stagewise::Pipe(seq, stagewise::balance{2, 3, 1},
///   stagewise::PipeOptions().chunks(4));
template <class... S>
class Pipe : public torch::nn::ModuleHolder<PipeImpl> {
 public:
  using list_type = stage_list<S...>;
  /// What the first stage takes and the last returns (checked at compile time).
  using input_type = typename list_type::input_type;
  using output_type = typename list_type::output_type;
  /// Which stage stashes and which pops each skip, computed at compile time.
  using skip_layout_type = skip_layout<S...>;
  // Each stash/pop mistake of the typed stages (and of their seq layers) is a compile error here.
  static_assert(detail::skips_checked<S...>);

  /// An empty holder, to assign later.
  Pipe(std::nullptr_t) : torch::nn::ModuleHolder<PipeImpl>(nullptr) {}  // NOLINT(implicit)

  /// A pipeline over typed stages.
  explicit Pipe(stage_list<S...> list, PipeOptions options = {})
      : torch::nn::ModuleHolder<PipeImpl>(
            std::make_shared<PipeImpl>(list.specs(), std::move(options), modules_of(list))) {}

  /// A pipeline over `seq`, split into stages of `b[k]` consecutive layers.
  template <class... T>
  requires(sizeof...(S) == 0 && sizeof...(T) == 0)
      Pipe(const torch::nn::Sequential& seq, const balance& b, PipeOptions options = {}, T...)
      : Pipe(with_deferred_batch_norm(seq, options), b, options, 0) {}

 private:
  static std::vector<std::shared_ptr<torch::nn::Module>> modules_of(const stage_list<S...>& list) {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (auto& spec : list.specs()) {
      if (spec.module) out.push_back(spec.module);
    }
    return out;
  }
  Pipe(const torch::nn::Sequential& seq, const balance& b, PipeOptions options, int)
      : torch::nn::ModuleHolder<PipeImpl>(std::make_shared<PipeImpl>(
            detail::partition(seq, b), std::move(options), layers_of(seq))) {}
  // With deferred_batch_norm(true), a copy of `seq` whose batch norms are DeferredBatchNorms
  // sharing their tensors (convert_deferred_batch_norm); otherwise `seq` itself.
  static torch::nn::Sequential with_deferred_batch_norm(const torch::nn::Sequential& seq,
                                                        const PipeOptions& options) {
    if (!options.deferred_batch_norm()) return seq;
    return convert_deferred_batch_norm(seq, options.chunks());
  }
  static std::vector<std::shared_ptr<torch::nn::Module>> layers_of(
      const torch::nn::Sequential& seq) {
    return seq->children();
  }
};

template <class... S>
Pipe(stage_list<S...>) -> Pipe<S...>;
template <class... S>
Pipe(stage_list<S...>, PipeOptions) -> Pipe<S...>;
Pipe(torch::nn::Sequential, balance)->Pipe<>;
Pipe(torch::nn::Sequential, balance, PipeOptions)->Pipe<>;

}  // namespace stagewise
