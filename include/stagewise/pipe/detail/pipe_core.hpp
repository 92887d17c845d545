#pragma once

// What every pipe holds and how its step runs (PipeOverImpl's base): the stages this process
// runs, their skip layout, the transport, the resolved options; building them, a step's
// micro-batches, its plan (kept in a PlanCache) and its run over the transport, the clip's norm
// gather and the saves' view of the pipe. PipeOverImpl (pipe/pipe_over.hpp) adds the public calls.

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
#include "stagewise/pipe/detail/pipe_saves.hpp"
#include "stagewise/pipe/detail/placed_stages.hpp"
#include "stagewise/pipe/detail/process_step.hpp"
#include "stagewise/pipe/detail/resolve.hpp"
#include "stagewise/pipe/detail/format1_save.hpp"
#include "stagewise/pipe/detail/save_format.hpp"
#include "stagewise/pipe/detail/scaled_step.hpp"
#include "stagewise/pipe/detail/stage_devices.hpp"
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

namespace stagewise::detail {

// The schedule of a train_step given none: the pipe's (PipeOptions().schedule(...), GPipe by
// default).
struct options_schedule {};
template <class S>
concept step_schedule = schedule::pipeline_schedule<S> || std::same_as<S, options_schedule>;

/// The state and the step machinery of `PipeOverImpl<Transport, Replicas>`, its base.
template <runtime::pipe_transport Transport, pipe_replicas Replicas>
class PipeCore : public PlacedStages {
 protected:
  /// `who` opens every error ("stagewise::Pipe"); `transport` is the one every step runs over.
  PipeCore(std::string who, PipeOptions options, std::unique_ptr<Transport> transport)
      : PlacedStages(who),
        who_(std::move(who)),
        where_(who_ + "::train_step"),
        options_(std::move(options)),
        transport_(std::move(transport)) {
    TORCH_CHECK(transport_ != nullptr, who_, ": the transport is null; give the pipe one");
  }

  /// Takes the resolved options (`detail::resolve_pipe`), verifies the skips of the stages'
  /// modules (every problem in one message), places the stages this process runs (the
  /// transport's `processes()`) on their devices and keeps them (registered as "stage<j>"); the
  /// others stay null: another process runs them.
  void build(detail::ResolvedPipe resolved) {
    resolved_ = std::move(resolved.options);
    auto& specs = resolved.specs;
    const auto here = transport_->processes();
    TORCH_CHECK(here.stage.empty() || here.stage.size() == specs.size(), who_,
                ": the transport places ", here.stage.size(), " stages but the balance makes ",
                specs.size(), "; build the transport for the pipe's stages");
    auto local = [&](std::size_t j) { return here.runs(j); };
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    const bool sequential = !resolved.layers.empty();
    for (std::size_t j = 0; j < specs.size(); ++j) {
      const auto& module = specs[j].module;
      modules.push_back(module);
      signatures_.push_back(module ? runtime::stage_signature(*module) : "");
      // Saves name tensors as the model does: a Sequential's stage by its layers' names, a typed
      // stage j as layer j.
      prefixes_.push_back(sequential ? "" : std::to_string(j) + ".");
      layers_.push_back(sequential && module ? static_cast<std::int64_t>(module->children().size())
                                             : 1);
      entries_.emplace_back();
      if (module) {
        for (auto& [entry, tensor] : detail::named_tensors(*module, prefixes_.back())) {
          entries_.back().push_back(std::move(entry));
        }
      }
    }
    skips_ = std::make_shared<const detail::SkipLayout>(detail::skip_layout_of(modules));
    const auto devices = detail::place_stage_modules(specs, resolved_.devices, who_, local);
    for (std::size_t j = 0; j < specs.size(); ++j) {
      if (!local(j)) {
        stages_.push_back(nullptr);  // another process's: its parameters are dropped here
        continue;
      }
      if (specs[j].module) {
        collect_deferred_batch_norms(*specs[j].module, j);
        register_module("stage" + std::to_string(j), specs[j].module);
      }
      stages_.push_back(std::make_unique<runtime::StageRuntime>(std::move(specs[j]), devices[j]));
    }
  }

  /// How the processes sum a GradScaler's inf/NaN check: null in one process, else through the
  /// transport's gather (distributed::Pipe: an all-reduce on its process group).
  virtual detail::FoundInfReduction found_inf_reduction() {
    return detail::gathered_found_inf(
        transport_->processes().count, [this](const std::string& what, const std::string& mine) {
          return transport_->gather(who_ + "::" + what, mine);
        });
  }

  /// How to build a pipe that runs a schedule placed otherwise, ending the error that refuses it
  /// (e.g. distributed::Pipe's Options().placed_like(schedule)).
  void set_placement_fix(std::string fix) { placement_fix_ = std::move(fix); }

  /// Each DeferredBatchNorm of this process's stages commits its running statistics after the
  /// mini-batch's last micro-batch, however many the batch splits into (every step, and the
  /// one-process pipe's forward).
  void begin_mini_batch(std::size_t micro_batches) {
    for (const auto& bn : deferred_) bn->begin_mini_batch(static_cast<int64_t>(micro_batches));
  }
  bool has_deferred_batch_norms() const { return !deferred_.empty(); }

  std::string who_;
  std::string where_;  // "<who>::train_step", opening train_step's errors
  PipeOptions options_;            // as the user gave them
  ResolvedPipeOptions resolved_;   // what the pipe runs with (build)
  std::shared_ptr<const detail::SkipLayout> skips_;
  std::vector<std::unique_ptr<runtime::StageRuntime>> stages_;  // null: another process's
  std::vector<std::string> signatures_;                         // of every stage, for saves
  // Every stage's parameters and buffers as saves name them, the prefix of those names, and the
  // model's layers each stage holds.
  std::vector<std::vector<detail::TensorEntry>> entries_;
  std::vector<std::string> prefixes_;
  std::vector<std::int64_t> layers_;
  Replicas replicas_;                                           // data parallelism, if any
  std::unique_ptr<Transport> transport_;                        // last: stops before the stages go

  // The parts the pipe's public calls use.
  // Finds the DeferredBatchNorm layers of stage `j`; with deferred_batch_norm(true), a plain batch
  // norm left in it (a typed stage, or one hidden in a custom module) is an error.
  void collect_deferred_batch_norms(const torch::nn::Module& module, std::size_t j) {
    if (resolved_.deferred_batch_norm)
      detail::refuse_hidden_batch_norm(module, "stage" + std::to_string(j));
    for (const auto& m : module.modules()) {
      if (auto bn = std::dynamic_pointer_cast<DeferredBatchNormImpl>(m)) deferred_.push_back(bn);
    }
  }

  std::vector<std::shared_ptr<DeferredBatchNormImpl>> deferred_;
  std::string placement_fix_;
  schedule::PlanCache plans_;  // each step's plan, made once per schedule and shape
  std::shared_ptr<const schedule::Plan> reductions_checked_;  // the last plan check_reductions passed
  amp::GradScaler* scaler_ = nullptr;  // the scaler of the step running now (detail::ScaledBy)

  // The clip's source of norms: every process's, in stage order (stage_norm_gather).
  optim::NormGather norm_gather(optim::FusedStep& fused, double max_norm, double norm_type) {
    auto gather = [this](const std::string& what, const torch::Tensor& values) {
      return runtime::gather_values(*transport_, who_ + "::" + what, values);
    };
    return detail::stage_norm_gather(transport_->processes(), stages_, fused.parameters(), gather,
                                     max_norm, norm_type, who_ + "::clip_grad_norm_step");
  }

  // The plan a format-1 save must have been made under to load here.
  detail::Format1Plan format1_plan() const {
    const auto here = transport_->processes();
    detail::Format1Plan p;
    p.processes = here.count;
    for (std::size_t j = 0; j < stages_.size(); ++j) {
      p.placement.push_back(here.of(j));
      p.devices.push_back(stages_[j] ? stages_[j]->device.str() : "");
    }
    p.signatures = signatures_;
    return p;
  }

  // This pipe's plan as a save records it. Replicas are replica-major (distributed::Pipe's
  // layout): a replica's processes are `workers` consecutive ranks.
  detail::SavePlan save_plan() const {
    const auto here = transport_->processes();
    int lowest = here.of(0), highest = here.of(0);
    for (std::size_t j = 0; j < stages_.size(); ++j) {
      lowest = std::min(lowest, here.of(j));
      highest = std::max(highest, here.of(j));
    }
    const int workers = highest - lowest + 1;
    detail::SavePlan p;
    p.processes = here.count;
    p.replicas = here.count / workers;
    for (std::size_t j = 0; j < stages_.size(); ++j) p.placement.push_back(here.of(j) - lowest);
    p.layers = layers_;
    return p;
  }

  // What save and load read of this pipe (pipe_saves.hpp).
  detail::PipeSaves saves() {
    const auto here = transport_->processes();
    const auto plan = save_plan();
    // Replica-major: the replica's first process runs the stage at rank 0 within the replica.
    const int replica = plan.placement.empty()
                            ? 0
                            : (here.of(0) - static_cast<int>(plan.placement[0])) /
                                  static_cast<int>(plan.workers());
    return {who_,
            {stages_, entries_, prefixes_, plan, here.rank, replica},
            replicas_.writes_stage_files(),
            {stages_, signatures_, format1_plan()},
            [this](const std::string& what, const std::string& mine) {
              return transport_->gather(who_ + "::" + what, mine);
            }};
  }

  // The step's micro-batches: this process's inputs and targets split by the options' chunks
  // (the first stage's process decides their number, the others learn it through the
  // transport), their weights, the loss and the checkpointed counts.
  runtime::TrainStep micro_batches_of(const Batch& input, const Batch& target,
                                      runtime::loss_fn_t loss_fn, int first_worker, bool first,
                                      bool last) {
    const std::string& where = where_;
    runtime::TrainStep step;
    if (first) step.inputs = scatter(input, resolved_.chunks);
    if (last) step.targets = scatter(target, resolved_.chunks);
    // The first stage's process decides the number of micro-batches; the others learn it
    // through the transport.
    const torch::Tensor count = transport_->share(
        first ? torch::tensor(static_cast<std::int64_t>(step.inputs.size())) : torch::Tensor(),
        first_worker, /*index=*/0);
    TORCH_CHECK(count.defined(), where,
                ": this process stopped before the step began (it aborted "
                "earlier); build a new pipe");
    const int m = static_cast<int>(count.item<std::int64_t>());
    TORCH_CHECK(!last || static_cast<int>(step.targets.size()) == m, where,
                ": the input splits into ", m, " micro-batches but the target into ",
                step.targets.size(), "; give them the same number of rows");
    if (!first) step.inputs.assign(static_cast<std::size_t>(m), Batch(torch::Tensor()));
    if (last) {
      step.weights = detail::row_weights(step.targets);
    } else {
      step.targets.assign(static_cast<std::size_t>(m), Batch(torch::Tensor()));
      step.weights.assign(static_cast<std::size_t>(m), 1.0 / m);
    }
    step.loss_fn = std::move(loss_fn);
    if (scaler_ != nullptr) step.loss_scale = detail::step_loss_scale(*scaler_, stages_);
    if (replicas_.many()) step.gradients_ready = [this](int j) { replicas_.gradients_ready(j); };
    step.training = is_training();
    step.stops = checkpoint_stops(resolved_.checkpoints, m, step.training);
    return step;
  }

  template <class Schedule>
  torch::Tensor run_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                         const Schedule& sched, const std::function<void(int)>& before,
                         schedule::Timeline* timeline) {
    if constexpr (std::is_same_v<Schedule, detail::options_schedule>) {
      return run_step(input, target, std::move(loss_fn), resolved_.schedule, before, timeline);
    } else {
      return run_scheduled(input, target, std::move(loss_fn), sched, before, timeline);
    }
  }

  template <class Schedule>
  torch::Tensor run_scheduled(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                              const Schedule& sched, const std::function<void(int)>& before,
                              schedule::Timeline* timeline) {
    const std::string& where = where_;
    const int n = static_cast<int>(stages_.size());
    TORCH_CHECK(n > 0, where, ": the pipe has no stages");
    TORCH_CHECK(torch::GradMode::is_enabled(), where,
                ": grad mode is off (a NoGradGuard is active); train_step computes gradients, so "
                "call it with grad enabled");
    const auto placement = schedule::placement_of(sched, n);
    detail::check_placement(transport_->processes(), placement, schedule::workers_of(sched, n),
                            where_, placement_fix_);
    const bool first = stages_.front() != nullptr, last = stages_.back() != nullptr;
    detail::check_step_rows(first ? &input : nullptr, last ? &target : nullptr, where.c_str());
    runtime::TrainStep step =
        micro_batches_of(input, target, std::move(loss_fn), placement.front(), first, last);
    const int m = static_cast<int>(step.weights.size());
    // The step's plan, made once for these arguments and then reused (PlanCache); with
    // PipeOptions().offload(...), its offloads and reloads, and the step's store opened.
    const auto planned =
        plans_.get(sched, n, m, std::vector<int>(step.stops.begin(), step.stops.end()),
                   detail::offload_costs_of(resolved_, step.stops));
    const schedule::Plan& plan = *planned;
    detail::open_offload_store(plan, resolved_, step, stages_);
    // Replicas reduce each stage's gradients at its point in the plan (schedule/reductions.hpp);
    // the transport verifies the pipeline's messages.
    if (replicas_.many() && planned != reductions_checked_) {
      if (auto problem = schedule::check_reductions(plan)) TORCH_CHECK(false, *problem);
      reductions_checked_ = planned;
    }
    if (!skips_->empty()) {
      step.skips = std::make_shared<runtime::detail::TrainSkips>(skips_, stages_.size(),
                                                                 static_cast<std::size_t>(m));
    }
    // Each micro-batch's input on stage 0's device and its target on the last stage's, moved
    // here on the caller's thread, after the caller's streams (the fence) and before any worker.
    runtime::StreamFence fence(stages_);
    if (first) stages_.front()->receive_from_caller(step.inputs);
    if (last) stages_.back()->receive_from_caller(step.targets);
    if (before) before(m);
    begin_mini_batch(static_cast<std::size_t>(m));
    transport_->begin_step(plan, skips_->stage_routes());
    // Worker w runs on the thread of its first stage here; null: another process's.
    std::vector<Worker*> workers(static_cast<std::size_t>(plan.workers), nullptr);
    for (int j = n - 1; j >= 0; --j) {
      auto& stage = stages_[static_cast<std::size_t>(j)];
      if (stage) workers[static_cast<std::size_t>(placement[j])] = &stage->worker;
    }
    torch::Tensor loss;
    try {
      loss = runtime::run_programs(stages_, plan, step, *transport_, workers, timeline);
    } catch (...) {
      // The first failure in time is the step's error (run_programs' is the first by worker).
      if (auto e = transport_->error()) std::rethrow_exception(e);
      throw;
    }
    if (auto e = transport_->error()) std::rethrow_exception(e);
    fence.leave();  // the loss is read on this thread next
    try {
      // The last stage's process has the loss; every process returns it, and only once every
      // process finished the step (a failure anywhere fails the step everywhere).
      loss =
          detail::share_loss(*transport_, replicas_, loss, target, last, placement.back(), where_);
      transport_->end_step();
    } catch (...) {
      transport_->abort(std::current_exception());  // the others stop too
      throw;
    }
    return loss;
  }
};

}  // namespace stagewise::detail
