#pragma once

// The one pipe: stages, their skip layout and a transport, and the training step written once.
// `stagewise::Pipe` is it over a MailboxTransport (every stage in this process);
// `distributed::Pipe` over a C10dTransport (this rank's stages, the rest elsewhere), with its
// replicas averaging gradients (`pipe_replicas`). A new transport is one header satisfying
// `runtime::pipe_transport` and one alias: `using MyPipe = stagewise::PipeOver<MyTransport>;`.

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/nn/convert_deferred_batch_norm.hpp"
#include "stagewise/nn/deferred_batch_norm.hpp"
#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/optim/grad_scaler.hpp"
#include "stagewise/optim/savable_optimizer.hpp"
#include "stagewise/pipe/detail/clip_norms.hpp"
#include "stagewise/pipe/detail/offload_step.hpp"
#include "stagewise/pipe/detail/pipe_core.hpp"
#include "stagewise/pipe/detail/pipe_saves.hpp"
#include "stagewise/pipe/detail/placed_stages.hpp"
#include "stagewise/pipe/detail/process_step.hpp"
#include "stagewise/pipe/detail/resolve.hpp"
#include "stagewise/pipe/detail/save_files.hpp"
#include "stagewise/pipe/detail/scaled_step.hpp"
#include "stagewise/pipe/detail/stage_devices.hpp"
#include "stagewise/pipe/detail/state_offload_step.hpp"
#include "stagewise/pipe/detail/step.hpp"
#include "stagewise/pipe/fused_stepper.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/pipe/replicas.hpp"
#include "stagewise/pipe/resolved_options.hpp"
#include "stagewise/runtime/detail/train_skips.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/runtime/program_executor.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/runtime/stage_signature.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/plan_cache.hpp"
#include "stagewise/schedule/reductions.hpp"
#include "stagewise/schedule/timeline.hpp"
#include "stagewise/skip/detail/inspect.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {

/// The pipe over any transport, behind the `PipeOver<Transport>` holder: the stages this process
/// runs (as `transport->processes()` says), their skip layout, and the training step, saves and
/// loads every pipe shares. `stagewise::Pipe` is it over `MailboxTransport`, `distributed::Pipe`
/// over `C10dTransport`; a transport of your own gets the same step, checks, fused step and
/// saves (docs/distributed.md, "A transport of your own").
///   auto pipe = stagewise::PipeOver<MyTransport>(seq, sw::balance{3, 2},
///   sw::PipeOptions().chunks(4),
///                                                std::make_unique<MyTransport>(...));
///   pipe->train_step(x, y, loss_fn, sw::schedule::one_f_one_b{});  // on every process
template <runtime::pipe_transport Transport, pipe_replicas Replicas = OneReplica>
class PipeOverImpl : public detail::PipeCore<Transport, Replicas> {
 public:
  /// Builds the stages of `seq` split by `b` that `transport` runs in this process
  /// (`processes()`), on the devices of `options`; the others are another process's. Every
  /// process builds the same model and balance.
  PipeOverImpl(const torch::nn::Sequential& seq, const balance& b, PipeOptions options,
               std::unique_ptr<Transport> transport)
      : PipeOverImpl("stagewise::PipeOver", std::move(options), std::move(transport)) {
    const auto here = transport_->processes();
    build(detail::resolve_pipe(
        options_, {.who = who_, .processes = here.count, .rank = here.rank}, seq, b));
  }

  /// One training step driven by `sched` (by default the pipe's: `PipeOptions().schedule(...)`,
  /// GPipe's fill-drain if none was given; also `schedule::one_f_one_b`,
  /// `interleaved_one_f_one_b`, `zero_bubble_h1`, or your own coroutine):
  /// returns the loss of the whole mini-batch and leaves the parameters' gradients accumulated, as
  /// `loss_fn(model(input), target).backward()` would. `loss_fn(output, target)` must average
  /// over the rows of its micro-batch (the default reduction of LibTorch's losses); each
  /// micro-batch's loss is weighted by its share of the rows. Every tensor of `input` and `target`
  /// must have the same, positive number of rows, and `loss_fn` must return a scalar: anything
  /// else is an error naming the fix. `input` and `target` may be on any device: each
  /// micro-batch's input moves to stage 0's device and its target to the last stage's, where
  /// `loss_fn` runs; the returned loss is on the last stage's device. An exception from a stage
  /// keeps its type and text and records its stage, micro-batch and phase (`error_context`). The
  /// schedule is verified before anything runs. If `timeline` is given, it receives every action's
  /// start and end in microseconds (of this process's stages; see `schedule::to_chrome_trace`).
  /// On a distributed pipe every rank calls it with the same schedule: the rank of the first
  /// stage gives `input`, the rank of the last stage gives `target` (the others may pass
  /// undefined tensors), and every rank returns the loss.
  ///   sw::schedule::Timeline t;
  ///   pipe->train_step(x, y, loss_fn, sw::schedule::zero_bubble_h1{}, &t);
  template <detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           const Schedule& sched = {}, schedule::Timeline* timeline = nullptr) {
    return run_step(input, target, std::move(loss_fn), sched, nullptr, timeline);
  }

  /// train_step for one input tensor and one target tensor.
  template <detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), sched, timeline);
  }

  /// train_step of the pipe's schedule (`PipeOptions().schedule(...)`, GPipe's by default),
  /// recording every action into `timeline`.
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           schedule::Timeline* timeline) {
    return run_step(input, target, std::move(loss_fn), resolved_.schedule, nullptr, timeline);
  }
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, schedule::Timeline* timeline) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), timeline);
  }

  /// train_step with the optimizer step fused into backward (e.g. `optim::FusedStep` over this
  /// pipe's, or this rank's, parameters): each parameter steps as soon as its stage's last
  /// micro-batch has been back-propagated, while the earlier stages are still in backward, and its
  /// gradient is freed at once. Equal, bit for bit, to train_step followed by the unfused
  /// optimizer's step (for SGD, Adam, AdamW, ...).
  ///   stagewise::optim::FusedStep fused(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  ///   auto loss = pipe->train_step(x, y, loss_fn, fused);  // no optimizer.step() needed
  template <fused_stepper Fused, detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           Fused& fused, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    if constexpr (std::is_same_v<Fused, optim::FusedStep>) {
      detail::refuse_local_clip(fused, transport_->processes(), where_);
      detail::offload_fused_state(fused, stages_, resolved_);  // optimizer_offload
    }
    if (replicas_.many()) {
      if constexpr (std::is_same_v<Fused, optim::FusedStep>) {
        return detail::with_reduced_fused_step(replicas_, fused, [&] {
          return run_step(input, target, std::move(loss_fn), sched, nullptr, timeline);
        });
      } else {
        TORCH_CHECK(false, where_,
                    ": a data-parallel pipe fuses only an optim::FusedStep into backward (it "
                    "steps each parameter on its gradient averaged over the replicas); pass one, "
                    "or call train_step without it and step your optimizer after");
      }
    }
    return detail::with_fused_step(fused, [&](const std::function<void(int)>& before) {
      return run_step(input, target, std::move(loss_fn), sched, before, timeline);
    });
  }

  /// The fused train_step for one input tensor and one target tensor.
  template <fused_stepper Fused, detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, Fused& fused, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), fused, sched, timeline);
  }

  /// train_step with fp16 loss scaling (`amp::GradScaler`): each micro-batch's weighted loss is
  /// multiplied by the scale before its backward, in every schedule; the loss returned is not
  /// scaled, the gradients are, as by `scaler.scale(loss).backward()`. Over several processes
  /// the scaler's inf/NaN check is summed over every rank, so all skip and scale alike.
  ///   pipe->train_step(x, y, loss_fn, scaler, sched); scaler.step(adam); scaler.update();
  template <detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           amp::GradScaler& scaler, const Schedule& sched = {},
                           schedule::Timeline* timeline = nullptr) {
    detail::ScaledBy scaled(scaler_, scaler, found_inf_reduction());
    return run_step(input, target, std::move(loss_fn), sched, nullptr, timeline);
  }

  /// The fused train_step under a GradScaler: it runs twice (`scaler.step(fused, closure)`), and
  /// the second pass steps every parameter only if the first found every gradient finite (on
  /// every rank); inside `pipe->clip_grad_norm_step(..., scaler)` once per pass of the clip.
  ///   pipe->train_step(x, y, loss_fn, fused, scaler, sched); scaler.update();
  template <detail::step_schedule Schedule = detail::options_schedule>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           optim::FusedStep& fused, amp::GradScaler& scaler,
                           const Schedule& sched = {}, schedule::Timeline* timeline = nullptr) {
    return detail::scaled_fused_step(fused, scaler, found_inf_reduction(), where_, [&] {
      detail::ScaledBy scaled(scaler_, scaler, nullptr);
      return train_step(input, target, loss_fn, fused, sched, timeline);
    });
  }

  /// `optim::clip_grad_norm_step` (same arguments) by the whole model's gradient norm, wherever
  /// its stages run: the fused step's norms of every process's stages (with data-parallel
  /// replicas, of the averaged gradients, counted once) are totalled in stage order, so every
  /// rank clips alike, by the one-process pipe's norm. Every rank calls it with the same max_norm.
  /// The norms cross processes through the transport's `runtime::gather_values` (over the process
  /// group for `distributed::Pipe`: nothing is left in the job's store).
  ///   auto r = pipe->clip_grad_norm_step(fused, [&] { pipe->train_step(x, y, f, fused); }, 1.0);
  template <optim::loss_closure F>
  optim::ClipStepResult clip_grad_norm_step(optim::FusedStep& fused, F&& closure, double max_norm,
                                            double norm_type = 2.0) {
    return optim::clip_grad_norm_step(fused, std::forward<F>(closure), max_norm, norm_type,
                                      norm_gather(fused, max_norm, norm_type));
  }

  /// The clip under a GradScaler: the first pass also unscales and checks every gradient, the
  /// update pass runs only if the step is finite on every rank; the closure passes the scaler on.
  ///   pipe->clip_grad_norm_step(fused, [&] { pipe->train_step(x, y, f, fused, scaler); }, 1.0,
  ///                             scaler);
  template <optim::loss_closure F>
  optim::ClipStepResult clip_grad_norm_step(optim::FusedStep& fused, F&& closure, double max_norm,
                                            amp::GradScaler& scaler, double norm_type = 2.0) {
    if (auto reduction = found_inf_reduction(); reduction && scaler.is_enabled()) {
      detail::GradScalerAccess::reduce_with(scaler, std::move(reduction));
    }
    return optim::clip_grad_norm_step(fused, std::forward<F>(closure), max_norm, scaler,
                                      norm_type, norm_gather(fused, max_norm, norm_type));
  }

  /// The optimizer offload of `PipeOptions().optimizer_offload(store, share)` for this process's
  /// stages (each stage's share of its parameters, largest first), for an unfused optimizer
  /// (a fused step given to `train_step` gets it by itself); an error without the option.
  ///   sw::optim::OffloadedOptimizer adam(pipe->named_parameters(),
  ///                                      torch::optim::AdamOptions(1e-3), pipe->offloaded_state());
  runtime::OffloadedState offloaded_state() const {
    return detail::offloaded_state_of(stages_, resolved_, who_);
  }

  /// The options the pipe was built with, as given.
  const PipeOptions& options() const { return options_; }
  /// What the pipe runs with: the options with every default and dependent choice decided (a
  /// memory budget's checkpoint modes and offloads included), resolved once at construction.
  const ResolvedPipeOptions& resolved_options() const { return resolved_; }
  /// What `PipeOptions().memory_budget(...)` chose: checkpoint mode, offloaded cells, each
  /// worker's predicted peak (print it with `to_string()`). Every pipe built from a Sequential
  /// with a budget has one (`Pipe`, `PipeOver<T>`, `distributed::Pipe`).
  ///   std::cout << pipe->memory_plan().to_string();
  const schedule::MemoryPlan& memory_plan() const {
    TORCH_CHECK(resolved_.memory_plan, who_,
                "::memory_plan: the pipe has no memory budget; build it from a Sequential with "
                "PipeOptions().memory_budget(bytes, sample)");
    return *resolved_.memory_plan;
  }
  /// Which stage stashes and which pops each skip connection (verified at construction).
  const detail::SkipLayout& skip_layout() const { return *skips_; }
  /// The messages and tensor bytes this process exchanged with other processes since the pipe
  /// was built (0 in one process).
  ///   const auto before = pipe->traffic();
  ///   pipe->train_step(x, y, loss_fn);
  ///   const auto sent = pipe->traffic().bytes_sent - before.bytes_sent;
  runtime::Traffic traffic() const { return transport_->traffic(); }

  /// Saves, at a step boundary, what a resumed job needs to continue: every parameter and buffer
  /// of this process's stages and `optimizer`'s state of each of its parameters (an unfused
  /// LibTorch optimizer over them, `optim::FusedStep`, any `savable_optimizer`), each under the
  /// model's own name ("3.weight": the Sequential's layer and the parameter's name), the
  /// random-number generators' states, `step` (any number of yours, given back by `load`) and an
  /// index of the files. Such a save loads into a pipe of any plan: another split, stage count,
  /// replica count, number of processes, fused or unfused step (`load`). Writes `dir`/stage<j>.pt
  /// and stage<j>.optimizer.pt for each of this process's stages (the first replica's), its
  /// rank<r>.pt, and once every process has written its part, index.pt, each whole or not at all
  /// (docs/pipe.md, "Save and resume"). Every process calls it, between steps; `save` returns on
  /// every process once all have saved, and a failure on any fails it on every one and leaves the
  /// save incomplete (without index.pt, which load refuses). Save each step to a directory of
  /// its own, so that a job killed while saving still has the previous one (`latest_save`).
  ///   pipe->save("ckpt/step-" + std::to_string(step), optimizer, step);
  template <savable_optimizer Optimizer>
  void save(const std::string& dir, const Optimizer& optimizer, std::int64_t step) {
    replicas_.wait_parameters(-1);  // sharded replicas: the owners' updates are in
    const auto access = detail::saving(optimizer);
    saves().save(dir, step, &access, {});
  }

  /// `save` with a GradScaler's state too (after `scaler.update()`): a resumed run scales alike.
  template <savable_optimizer Optimizer>
  void save(const std::string& dir, const Optimizer& optimizer, const amp::GradScaler& scaler,
            std::int64_t step) {
    replicas_.wait_parameters(-1);
    const auto access = detail::saving(optimizer);
    saves().save(
        dir, step, &access,
        {.save = [&](torch::serialize::OutputArchive& a) { detail::save_scaler(a, scaler); }});
  }

  /// Saves the stages' parameters, buffers and the generators' states, without an optimizer.
  void save(const std::string& dir, std::int64_t step) {
    replicas_.wait_parameters(-1);
    saves().save(dir, step, nullptr, {});
  }

  /// Resumes from a save (`save`) made under any plan: loads this process's stages' parameters
  /// and buffers and `optimizer`'s state of each of its parameters, by the model's names, from
  /// the files of the save that hold them (and no others), the generators' states, and returns
  /// the saved step. The save may come from another split, number of stages, processes or
  /// replicas, or from a one-process pipe into a distributed one and back, fused or unfused;
  /// under the plan that made it each process restores its own generators, under another the
  /// generators of the process that ran its first layer (docs/distributed.md, "Resume on other
  /// ranks"). A save of another model (names, shapes or dtypes that differ), of another
  /// optimizer kind, an incomplete save (no index.pt), a damaged file, a save of a newer format,
  /// or ranks given saves of different steps is an error naming it, on every rank, before
  /// anything is changed. A save of format 1 (an older stagewise's) loads under the plan that
  /// made it. Call it on every process, before the first step or between steps; the
  /// optimizer's options (its learning rate) stay as you built them.
  ///   const auto step = pipe->load("ckpt/step-100", optimizer) + 1;  // the next step to run
  template <savable_optimizer Optimizer>
  std::int64_t load(const std::string& dir, Optimizer& optimizer) {
    before_load(optimizer);
    const auto access = detail::loading(optimizer);
    return saves().load(dir, &access, {});
  }

  /// `load` with a GradScaler's state too; a save without one is refused, changing nothing.
  template <savable_optimizer Optimizer>
  std::int64_t load(const std::string& dir, Optimizer& optimizer, amp::GradScaler& scaler) {
    before_load(optimizer);
    const auto access = detail::loading(optimizer);
    return saves().load(
        dir, &access,
        {.check =
             [&](torch::serialize::InputArchive& a) {
               detail::check_scaler_saved(a, who_ + "::load: ", dir);
             },
         .load = [&](torch::serialize::InputArchive& a) { detail::load_scaler(a, scaler); }});
  }

  /// Loads the stages' parameters, buffers and the generators' states of a save, leaving any
  /// saved optimizer state unread (e.g. to evaluate a saved model).
  std::int64_t load(const std::string& dir) {
    replicas_.wait_parameters(-1);
    return saves().load(dir, nullptr, {});
  }

  /// The transport the pipe's steps run over.
  Transport& transport() { return *transport_; }
  const Transport& transport() const { return *transport_; }
  /// Which processes exist and which stages each runs (the transport's).
  runtime::Processes processes() const { return transport_->processes(); }
  /// The thread of stage `j`'s worker in this process (a worker running several stages of a
  /// schedule runs on the thread of its first), e.g. to attribute memory with `MemoryMeter`.
  std::thread::id stage_thread(std::size_t j) const {
    TORCH_CHECK_INDEX(j < stages_.size() && stages_[j] != nullptr, who_, ": stage ", j,
                      " does not run in this process (it has ", stages_.size(), " stages)");
    return stages_[j]->worker.id();
  }

 protected:
  using Core = detail::PipeCore<Transport, Replicas>;
  /// `who` opens every error ("stagewise::Pipe"); `transport` is the one every step runs over.
  PipeOverImpl(std::string who, PipeOptions options, std::unique_ptr<Transport> transport)
      : Core(std::move(who), std::move(options), std::move(transport)) {}
  using Core::build;
  using Core::found_inf_reduction;
  using Core::options_;
  using Core::replicas_;
  using Core::resolved_;
  using Core::signatures_;
  using Core::skips_;
  using Core::stages_;
  using Core::transport_;
  using Core::where_;
  using Core::who_;

 private:
  // Before a load: no update still on its way overwrites what it loads, and a sharded fused
  // step keeps (and requires) the state of the parameters this replica owns.
  template <class Optimizer>
  void before_load(Optimizer& optimizer) {
    replicas_.wait_parameters(-1);
    if constexpr (std::is_same_v<Optimizer, optim::FusedStep>) replicas_.own(optimizer);
  }

  using Core::norm_gather;
  using Core::run_step;
  using Core::saves;
  using Core::scaler_;
};

/// A pipe over a transport of your own (any `runtime::pipe_transport`), a module holder like
/// `stagewise::Pipe`: `pipe->train_step(...)`, `pipe->parameters()` (this process's stages),
/// `pipe->save(...)`. A new transport is one header and this alias:
///   using WirePipe = stagewise::PipeOver<WireEnd>;
///   WirePipe pipe(seq, sw::balance{3, 2}, sw::PipeOptions().chunks(4),
///                 std::make_unique<WireEnd>(wire, rank));
template <runtime::pipe_transport Transport>
class PipeOver : public torch::nn::ModuleHolder<PipeOverImpl<Transport>> {
 public:
  /// An empty holder, to assign later.
  PipeOver(std::nullptr_t) : torch::nn::ModuleHolder<PipeOverImpl<Transport>>(nullptr) {}  // NOLINT
  /// Builds this process's stages of `seq` split by `b` over `transport` (see PipeOverImpl).
  PipeOver(const torch::nn::Sequential& seq, const balance& b, PipeOptions options,
           std::unique_ptr<Transport> transport)
      : torch::nn::ModuleHolder<PipeOverImpl<Transport>>(std::make_shared<PipeOverImpl<Transport>>(
            seq, b, std::move(options), std::move(transport))) {}
};

}  // namespace stagewise
