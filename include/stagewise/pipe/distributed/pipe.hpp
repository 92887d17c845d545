#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/pipe/detail/placed_stages.hpp"
#include "stagewise/pipe/detail/stage_devices.hpp"
#include "stagewise/pipe/detail/step.hpp"
#include "stagewise/pipe/fused_stepper.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
#include "stagewise/runtime/program_executor.hpp"
#include "stagewise/runtime/stage_runtime.hpp"
#include "stagewise/schedule/comms.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/skip/detail/inspect.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::distributed {

/// Options of a distributed pipe, beyond the one-process `PipeOptions`.
///   stagewise::distributed::Options().virtual_stages(2).timeout(std::chrono::seconds(10))
struct Options {
  /// Stages per rank: 1 (default; GPipe, 1F1B, ZB-H1) or v for `interleaved_one_f_one_b{v}`,
  /// which runs stages r, r + K, ... on rank r of K.
  Options& virtual_stages(int v) {
    virtual_stages_ = v;
    return *this;
  }
  /// How long a rank waits for a message, and for the others at start-up (default 30 s): after
  /// it, every rank fails with an error naming the rank that did not answer.
  Options& timeout(std::chrono::milliseconds t) {
    transport_.timeout(t);
    connect_.timeout = t;
    return *this;
  }
  /// The transport's options (poll interval, device of received tensors, store key prefix).
  Options& transport(runtime::C10dOptions t) {
    transport_ = std::move(t);
    return *this;
  }
  /// Places the stages on ranks as schedule `s` places them on workers, for schedules whose
  /// placement is not stage j on rank j % K: the V-shaped `zero_bubble_v` and `dualpipe_v` (rank
  /// w runs stages w and 2K-1-w). Overrides virtual_stages; train_step then takes a schedule
  /// with the same placement.
  ///   stagewise::distributed::Options().placed_like(stagewise::schedule::zero_bubble_v{})
  template <schedule::pipeline_schedule S>
  Options& placed_like(const S& s) {
    placement_ = [s](int stages) { return schedule::placement_of(s, stages); };
    return *this;
  }
  /// The backend `connect` builds when the pipe rendezvouses itself (Gloo by default).
  Options& backend(runtime::Backend b) {
    connect_.backend = b;
    return *this;
  }

  /// What the setters above set, read back (as `PipeOptions`' getters are).
  int virtual_stages() const { return virtual_stages_; }
  /// Every stage's rank for a number of stages (`placed_like`); null: stage j on rank
  /// j % (stages / v).
  const std::function<std::vector<int>(int)>& placement() const { return placement_; }
  const runtime::C10dOptions& transport() const { return transport_; }
  /// The rendezvous options (`backend`, `timeout`).
  const runtime::ConnectOptions& connect() const { return connect_; }

 private:
  int virtual_stages_ = 1;
  std::function<std::vector<int>(int)> placement_;
  runtime::C10dOptions transport_;
  runtime::ConnectOptions connect_;
};

/// The distributed pipeline, behind the `Pipe` holder (used as `pipe->`, like the one-process
/// `stagewise::Pipe`): its stages live in separate processes (ranks), on one machine or several.
/// Every rank builds the same torch::nn::Sequential and balance and calls the same `train_step`;
/// each keeps only its own stages (stage j on rank j % K for K ranks, or as
/// `Options::placed_like` says) and runs them with the same execution core as the one-process
/// `Pipe`, exchanging activations, gradients and skip tensors over c10d. Rank placement, world
/// size and the model's shapes are checked before any step, and each step's communication is
/// verified deadlock-free (`schedule::verify_comms`).
///   // every rank, started by tools/launch -n 2 (or torchrun):
///   auto pipe = stagewise::distributed::Pipe(seq, sw::balance{2, 2}, sw::PipeOptions().chunks(8));
///   auto loss = pipe->train_step(x, y, loss_fn, sw::schedule::one_f_one_b{});  // every rank
/// This rank's stages are its registered submodules ("stage<j>"): `pipe->parameters()` gives
/// them to this rank's optimizer, `pipe->train(false)` / `pipe->eval()` switch their mode.
class PipeImpl : public ::stagewise::detail::PlacedStages {
 public:
  /// Rendezvouses from the environment (`torchrun`'s MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
  /// LOCAL_RANK) and builds this rank's stages of `seq` split by `b`.
  PipeImpl(const torch::nn::Sequential& seq, const balance& b, PipeOptions options = {},
           Options dist = {})
      : PipeImpl(runtime::connect(runtime::rendezvous_env(), dist.connect()), seq, b,
                 std::move(options), std::move(dist)) {}

  /// Builds this rank's stages over a job the caller already joined (`runtime::connect`, or a
  /// Connection over the caller's own process group and store).
  PipeImpl(runtime::Connection connection, const torch::nn::Sequential& seq, const balance& b,
           PipeOptions options = {}, Options dist = {})
      : ::stagewise::detail::PlacedStages("stagewise::distributed::Pipe"),
        connection_(std::move(connection)),
        options_(std::move(options)),
        dist_(std::move(dist)),
        prefix_(dist_.transport().prefix_) {
    auto specs = ::stagewise::detail::partition(seq, b);
    const int n = static_cast<int>(specs.size());
    if (dist_.placement()) {
      placement_ = dist_.placement()(n);
    } else {
      const int v = dist_.virtual_stages();
      TORCH_CHECK(v >= 1 && n % v == 0, "stagewise::distributed::Pipe: ", n,
                  " stages do not split into ", v, " virtual stages per rank; give a balance ",
                  "with a multiple of ", v, " entries or change Options::virtual_stages");
      for (int j = 0; j < n; ++j) placement_.push_back(j % (n / v));
    }
    workers_ = *std::max_element(placement_.begin(), placement_.end()) + 1;
    runtime::check_world_size(connection_, n, workers_);
    {
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      for (const auto& spec : specs) modules.push_back(spec.module);
      skips_ = std::make_shared<const ::stagewise::detail::SkipLayout>(
          ::stagewise::detail::skip_layout_of(modules));
    }
    std::vector<std::string> signatures;
    for (const auto& spec : specs) {
      signatures.push_back(spec.module ? runtime::stage_signature(*spec.module) : "");
    }
    runtime::check_same_model(connection_, signatures, prefix_ + "/model", dist_.connect().timeout);
    const auto devices = ::stagewise::detail::place_stage_modules(
        specs, options_.devices(), "stagewise::distributed::Pipe",
        [&](std::size_t k) { return rank_of(static_cast<int>(k)) == rank(); });
    for (int j = 0; j < n; ++j) {
      if (rank_of(j) != rank()) {
        stages_.push_back(nullptr);  // another rank's: its parameters are dropped here
        continue;
      }
      const auto k = static_cast<std::size_t>(j);
      if (specs[k].module) register_module("stage" + std::to_string(j), specs[k].module);
      stages_.push_back(std::make_unique<runtime::StageRuntime>(std::move(specs[k]), devices[k]));
    }
    std::vector<schedule::SkipRoute> routes;
    for (const auto& r : skips_->routes()) {
      routes.push_back({static_cast<int>(r.stash_stage), static_cast<int>(r.pop_stage)});
    }
    routes_ = routes;
    transport_ = std::make_unique<runtime::C10dTransport>(
        connection_,
        [placement = placement_](int stage) { return placement[static_cast<std::size_t>(stage)]; },
        std::move(routes), dist_.transport());
  }

  /// One training step on every rank, as `Pipe::train_step` does in one process: the rank of
  /// the first stage gives `input`, the rank of the last stage gives `target` (the others may
  /// pass undefined tensors); every rank returns the mini-batch's loss. Gradients accumulate in
  /// this rank's stages' parameters. Every rank must pass the same schedule.
  ///   auto loss = pipe->train_step(x, y, loss_fn, stagewise::schedule::gpipe{});
  template <schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           const Schedule& sched = {}) {
    return run(input, target, std::move(loss_fn), sched, nullptr);
  }

  /// train_step for one input tensor and one target tensor.
  template <schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, const Schedule& sched = {}) {
    return run(Batch(input), Batch(target), std::move(loss_fn), sched, nullptr);
  }

  /// train_step with the optimizer step fused into backward, per stage of this rank (e.g.
  /// `optim::FusedStep` over `parameters()`): equal, bit for bit, to train_step followed by the
  /// unfused optimizer's step.
  template <fused_stepper Fused, schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                           Fused& fused, const Schedule& sched = {}) {
    return ::stagewise::detail::with_fused_step(fused, [&](const std::function<void(int)>& before) {
      return run(input, target, std::move(loss_fn), sched, before);
    });
  }

  /// The fused train_step for one input tensor and one target tensor.
  template <fused_stepper Fused, schedule::pipeline_schedule Schedule = schedule::gpipe>
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           runtime::loss_fn_t loss_fn, Fused& fused, const Schedule& sched = {}) {
    return train_step(Batch(input), Batch(target), std::move(loss_fn), fused, sched);
  }

  /// This process's rank and the number of ranks.
  int rank() const { return connection_.env.rank; }
  int world_size() const { return connection_.env.world_size; }
  /// Number of stages of the whole pipe.
  int num_stages() const { return static_cast<int>(stages_.size()); }
  /// The rank that runs stage `j`.
  int rank_of(int j) const { return placement_.at(static_cast<std::size_t>(j)); }
  /// Whether stage `j` runs on this rank.
  bool has_stage(int j) const {
    return j >= 0 && j < num_stages() && stages_[static_cast<std::size_t>(j)] != nullptr;
  }
  /// The messages and tensor bytes this rank exchanged with the other ranks since the pipe was
  /// built (activations, gradients and skips; messages between this rank's own stages move
  /// nothing and are not counted).
  ///   const auto before = pipe->traffic();
  ///   pipe->train_step(x, y, loss_fn);
  ///   const auto sent = pipe->traffic().bytes_sent - before.bytes_sent;
  runtime::C10dTraffic traffic() const { return transport_->traffic(); }
  /// Train or eval mode for this rank's stages (checkpointing runs only in training). Moving
  /// the pipe with to(device) is refused (PlacedStages); to(dtype) is allowed.
  void train(bool on = true) override { torch::nn::Module::train(on); }

 private:
  template <class Schedule>
  torch::Tensor run(const Batch& input, const Batch& target, runtime::loss_fn_t loss_fn,
                    const Schedule& sched, const std::function<void(int)>& before) {
    TORCH_CHECK(torch::GradMode::is_enabled(),
                "stagewise::distributed::Pipe::train_step: grad mode is off (a NoGradGuard is "
                "active); train_step computes gradients, so call it with grad enabled");
    const int n = num_stages();
    TORCH_CHECK(schedule::workers_of(sched, n) == workers_,
                "stagewise::distributed::Pipe::train_step: the schedule runs the ", n,
                " stages on ", schedule::workers_of(sched, n),
                " workers but the pipe was built for ", workers_,
                " ranks (Options::virtual_stages ", dist_.virtual_stages(),
                "); build the pipe with the schedule's stages per rank");
    const auto placement = schedule::placement_of(sched, n);
    for (int j = 0; j < n; ++j) {
      TORCH_CHECK(placement[static_cast<std::size_t>(j)] == rank_of(j),
                  "stagewise::distributed::Pipe::train_step: the schedule runs stage ", j,
                  " on worker ", placement[static_cast<std::size_t>(j)],
                  " but the pipe keeps it on rank ", rank_of(j),
                  "; build the pipe with Options().placed_like(schedule) for a V-shaped schedule, "
                  "or pass a schedule that places stage j on rank j % ",
                  workers_);
    }
    const bool first = has_stage(0), last = has_stage(n - 1);
    ::stagewise::detail::check_step_rows(first ? &input : nullptr, last ? &target : nullptr,
                                         "stagewise::distributed::Pipe::train_step");
    runtime::TrainStep step;
    if (first) step.inputs = scatter(input, options_.chunks());
    if (last) step.targets = scatter(target, options_.chunks());
    // The first stage's rank decides the number of micro-batches; the others learn it through
    // the transport.
    const auto count = transport_->share(
        first ? torch::tensor(static_cast<std::int64_t>(step.inputs.size())) : torch::Tensor(),
        rank_of(0), /*index=*/0);
    TORCH_CHECK(count.defined(), "stagewise::distributed::Pipe::train_step: rank ", rank(),
                " stopped before the step began (it aborted earlier)");
    const int m = static_cast<int>(count.item<std::int64_t>());
    TORCH_CHECK(!last || static_cast<int>(step.targets.size()) == m,
                "stagewise::distributed::Pipe::train_step: the input on rank ", rank_of(0),
                " splits into ", m, " micro-batches but the target on rank ", rank(), " into ",
                step.targets.size(), "; give them the same number of rows");
    if (!first) step.inputs.assign(static_cast<std::size_t>(m), Batch(torch::Tensor()));
    if (last) {
      step.weights = ::stagewise::detail::row_weights(step.targets);
    } else {
      step.targets.assign(static_cast<std::size_t>(m), Batch(torch::Tensor()));
      step.weights.assign(static_cast<std::size_t>(m), 1.0 / m);
    }
    step.loss_fn = std::move(loss_fn);
    step.training = is_training();
    step.stop = checkpoint_stop(options_.checkpoint(), m, step.training);
    const auto plan = schedule::plan(sched, n, m, static_cast<int>(step.stop));
    schedule::verify_comms(plan, routes_);
    if (!skips_->empty()) {
      step.skips = std::make_shared<::stagewise::runtime::detail::TrainSkips>(
          skips_, stages_.size(), static_cast<std::size_t>(m));
    }
    // This rank's inputs on stage 0's device and targets on the last stage's (see Pipe).
    runtime::StreamFence fence(stages_);
    if (first) stages_.front()->receive_from_caller(step.inputs);
    if (last) stages_.back()->receive_from_caller(step.targets);
    if (before) before(m);
    transport_->begin_step(n, m, static_cast<int>(routes_.size()));
    // Every receive of the step is posted now, in the verified order: messages travel while this
    // rank computes.
    transport_->expect(runtime::receives_of(schedule::comms(plan, routes_), rank()));
    // This rank's one worker thread runs all of its stages, in plan order.
    std::vector<Worker*> workers(static_cast<std::size_t>(workers_), nullptr);
    for (int j = 0; j < n; ++j) {
      if (has_stage(j)) {
        workers[static_cast<std::size_t>(rank())] = &stages_[static_cast<std::size_t>(j)]->worker;
        break;
      }
    }
    torch::Tensor loss = runtime::run_programs(stages_, plan, step, *transport_, workers);
    fence.leave();  // the loss is read on this thread next
    // The last stage's rank has the loss; every rank returns it.
    loss = transport_->share(loss, rank_of(n - 1), /*index=*/1);
    return loss;
  }

  runtime::Connection connection_;
  PipeOptions options_;
  Options dist_;
  std::string prefix_;
  int workers_ = 1;
  std::vector<int> placement_;  // the rank of every stage
  std::shared_ptr<const ::stagewise::detail::SkipLayout> skips_;
  std::vector<schedule::SkipRoute> routes_;
  std::vector<std::unique_ptr<runtime::StageRuntime>> stages_;
  std::unique_ptr<runtime::C10dTransport> transport_;  // last: stops before the stages go
};

/// The distributed pipe's holder: `stagewise::distributed::Pipe pipe(seq, balance, options)`,
/// then `pipe->train_step(...)`, as with the one-process `stagewise::Pipe`.
class Pipe : public torch::nn::ModuleHolder<PipeImpl> {
 public:
  /// An empty holder, to assign later.
  Pipe(std::nullptr_t) : torch::nn::ModuleHolder<PipeImpl>(nullptr) {}  // NOLINT(implicit)
  /// Rendezvouses from the environment and builds this rank's stages (see PipeImpl).
  Pipe(const torch::nn::Sequential& seq, const balance& b, PipeOptions options = {},
       Options dist = {})
      : torch::nn::ModuleHolder<PipeImpl>(
            std::make_shared<PipeImpl>(seq, b, std::move(options), std::move(dist))) {}
  /// Builds this rank's stages over a job the caller already joined (see PipeImpl).
  Pipe(runtime::Connection connection, const torch::nn::Sequential& seq, const balance& b,
       PipeOptions options = {}, Options dist = {})
      : torch::nn::ModuleHolder<PipeImpl>(std::make_shared<PipeImpl>(
            std::move(connection), seq, b, std::move(options), std::move(dist))) {}
};

}  // namespace stagewise::distributed
