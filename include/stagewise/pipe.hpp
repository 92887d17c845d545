#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/pipe/detail/resolve.hpp"
#include "stagewise/pipe/detail/stage_devices.hpp"
#include "stagewise/pipe/fused_stepper.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/runtime/clock_executor.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/timeline.hpp"
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
class PipeImpl : public PipeOverImpl<runtime::MailboxTransport> {
 public:
  /// The pipe over typed stages (`specs`, whose modules are `layers`).
  PipeImpl(std::vector<detail::StageSpec> specs, PipeOptions options,
           std::vector<std::shared_ptr<torch::nn::Module>> layers)
      : PipeOverImpl("stagewise::Pipe", std::move(options),
                     std::make_unique<runtime::MailboxTransport>()),
        layers_(std::move(layers)) {
    build_checked(detail::resolve_pipe(options_, {.who = who_}, std::move(specs)));
  }
  /// The pipe over `seq` split by `b`.
  PipeImpl(const torch::nn::Sequential& seq, const balance& b, PipeOptions options)
      : PipeOverImpl("stagewise::Pipe", std::move(options),
                     std::make_unique<runtime::MailboxTransport>()) {
    auto resolved = detail::resolve_pipe(options_, {.who = who_}, seq, b);
    layers_ = resolved.layers;
    build_checked(std::move(resolved));
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
    if (has_deferred_batch_norms()) begin_mini_batch(scatter(input, resolved_.chunks).size());
    return runtime::run_clock_cycles(stages_, input, resolved_.chunks, resolved_.checkpoints,
                                     is_training(), skips_->empty() ? nullptr : skips_);
  }

  // train_step (four overloads), options(), skip_layout(), save, load: PipeOverImpl, the step
  // every pipe shares.

  /// Number of stages.
  std::size_t num_stages() const { return stages_.size(); }
  // memory_plan(): PipeOverImpl, as every pipe has it.
  /// The device of stage `k`.
  torch::Device device(std::size_t k) const { return stage_at(k).device; }
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

  void build_checked(detail::ResolvedPipe resolved) {
    verify_ownership(resolved.specs);
    build(std::move(resolved));
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

  std::vector<std::shared_ptr<torch::nn::Module>> layers_;
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
      : torch::nn::ModuleHolder<PipeImpl>(std::make_shared<PipeImpl>(seq, b, std::move(options))) {
  }

  /// The pipeline `plan` describes (`plan_pipeline`): its split of `seq`, its micro-batches,
  /// checkpoint modes, offloads, and the schedule `train_step` runs. Place the stages with
  /// `sw::Pipe(seq, plan.split, plan.options().devices(...))`.
  ///   auto pipe = stagewise::Pipe(model, stagewise::plan_pipeline(model, batch, plan_options));
  template <class... T>
  requires(sizeof...(S) == 0 && sizeof...(T) == 0)
      Pipe(const torch::nn::Sequential& seq, const PipelinePlan& plan, T...)
      : Pipe(seq, one_process(plan).split, plan.options()) {}

 private:
  // A plan for the ranks of a distributed job (PlanOptions().ranks(N), N > 1) is refused: its
  // memory and times are counted for one stage's worker per rank and d replicas.
  static const PipelinePlan& one_process(const PipelinePlan& plan) {
    TORCH_CHECK(plan.ranks <= 1, "stagewise::Pipe: the plan is for a job of ", plan.ranks,
                " ranks (", plan.workers, " per pipeline x ", plan.replicas,
                " replicas); build it on every rank with sw::distributed::Pipe(model, plan), or "
                "plan one process with PlanOptions().workers(K)");
    return plan;
  }
  static std::vector<std::shared_ptr<torch::nn::Module>> modules_of(const stage_list<S...>& list) {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (auto& spec : list.specs()) {
      if (spec.module) out.push_back(spec.module);
    }
    return out;
  }
};

template <class... S>
Pipe(stage_list<S...>) -> Pipe<S...>;
template <class... S>
Pipe(stage_list<S...>, PipeOptions) -> Pipe<S...>;
Pipe(torch::nn::Sequential, balance)->Pipe<>;
Pipe(torch::nn::Sequential, balance, PipeOptions)->Pipe<>;
Pipe(torch::nn::Sequential, PipelinePlan)->Pipe<>;

}  // namespace stagewise
