#pragma once

#include "stagewise/pipe/detail/clip_norms.hpp"
#include "stagewise/pipe/distributed/detail/agreed_plan.hpp"
#include "stagewise/pipe/distributed/detail/replica_gradients.hpp"
#include "stagewise/pipe/distributed/options.hpp"
#include "stagewise/pipe/distributed/sharded.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/c10d/subgroup.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::distributed {

class Pipe;

/// The distributed pipeline, behind the `Pipe` holder (used as `pipe->`, like the one-process
/// `stagewise::Pipe`): its stages live in separate processes (ranks), on one machine or several.
/// Every rank builds the same torch::nn::Sequential and balance and calls the same `train_step`;
/// each keeps only its own stages (stage j on rank j % K for K ranks, or as
/// `Options::placed_like` says) and runs them with the same execution core as the one-process
/// `Pipe`, exchanging activations, gradients and skip tensors over c10d. Rank placement, world
/// size, the wire format and the model's shapes are checked before any step, and each step's
/// communication is verified deadlock-free (`schedule::verify_comms`).
///   // every rank, started by tools/launch -n 2 (or torchrun):
///   auto pipe = stagewise::distributed::Pipe(seq, sw::balance{2, 2}, sw::PipeOptions().chunks(8));
///   auto loss = pipe->train_step(x, y, loss_fn, sw::schedule::one_f_one_b{});  // every rank
/// This rank's stages are its registered submodules ("stage<j>"): `pipe->parameters()` gives
/// them to this rank's optimizer, `pipe->train(false)` / `pipe->eval()` switch their mode.
/// With `Options().data_parallel(d)` the job runs d replicas of the pipeline, each on its rows of
/// the global batch (`shard`, `layout`), and every stage's gradients are averaged over its
/// replicas before train_step returns; see docs/distributed.md, "Pipeline x data parallel".
class PipeImpl : public PipeOverImpl<runtime::C10dTransport, detail::ReplicaGradients> {
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
      : PipeImpl(prepare(std::move(connection), seq, b, options, dist), options, dist) {}

  // train_step (four overloads; every rank calls it), options(), skip_layout() and traffic()
  // (the messages and tensor bytes this rank exchanged with the others since the pipe was built;
  // messages between this rank's own stages move nothing and are not counted): PipeOverImpl, the
  // step every pipe shares.

  /// This process's rank in the job and the job's number of ranks.
  int rank() const { return job_.env.rank; }
  int world_size() const { return job_.env.world_size; }
  /// Number of stages of the whole pipe.
  int num_stages() const { return static_cast<int>(stages_.size()); }
  /// The rank, within each replica, that runs stage `j` (the job rank is replica() * ranks per
  /// replica + rank_of(j)).
  int rank_of(int j) const { return placement_.at(static_cast<std::size_t>(j)); }
  /// Whether stage `j` runs on this rank.
  bool has_stage(int j) const {
    return j >= 0 && j < num_stages() && stages_[static_cast<std::size_t>(j)] != nullptr;
  }
  /// The data-parallel replicas (Options::data_parallel), this rank's replica, and its rank
  /// within the replica.
  int replicas() const { return dist_.data_parallel(); }
  /// Built from a plan (`Pipe(model, plan)`): the plan every rank runs, rank 0's (a rank's own
  /// plan may differ where two candidates were close); empty otherwise. A one-process reference
  /// of the same pipe: `sw::Pipe(model, pipe->plan()->split, pipe->plan()->options())`.
  const std::optional<PipelinePlan>& plan() const { return plan_; }
  int replica() const { return rank() / workers_; }
  int pipeline_rank() const { return rank() % workers_; }

  /// This replica's rows of a global batch: the replica()-th of replicas() equal slices along
  /// dim 0 (all of it with one replica). Give it to train_step as the input (on the first
  /// stage's rank) and the target (on the last stage's). The rows must split evenly: the
  /// replicas' mean gradients are averaged with equal weights.
  ///   auto loss = pipe->train_step(pipe->shard(x), pipe->shard(y), loss_fn, schedule);
  torch::Tensor shard(const torch::Tensor& global) const {
    const int d = replicas();
    if (d == 1) return global;
    TORCH_CHECK(global.defined() && global.dim() > 0,
                "stagewise::distributed::Pipe::shard: give a tensor whose first dimension is the "
                "batch");
    const auto rows = global.size(0);
    TORCH_CHECK(rows % d == 0, "stagewise::distributed::Pipe::shard: the batch has ", rows,
                " rows, which do not split evenly over ", d,
                " replicas (unequal shares would weight rows unequally); give a multiple of ", d,
                " rows");
    return global.narrow(0, replica() * (rows / d), rows / d);
  }

  /// Bytes of gradients this rank all-reduced with the other replicas in the last step (its
  /// stages' gradients, bucket by bucket; 0 with one replica).
  std::int64_t bytes_reduced_last_step() const {
    return replicas_.bytes_last_step();
  }

  /// With `Options().shard_optimizer_state(true)`: what a sharded optimizer steps
  /// (`distributed::Sharded<Optimizer>` takes the pipe): this rank's stages' parameters (as
  /// `parameters()` lists them), which this replica owns, and how the ranks exchange updated
  /// parameters (waited for before each stage's next forward), inf/NaN checks (over every rank)
  /// and gradient norms (every stage and shard).
  ///   sw::distributed::Sharded<torch::optim::Adam> adam(pipe, torch::optim::AdamOptions(1e-3));
  ShardedParameters sharded_parameters() {
    ShardedParameters s;
    s.who = "stagewise::distributed::Pipe";
    TORCH_CHECK(replicas_.sharded(), s.who,
                ": the optimizer state is not sharded; build the pipe with "
                "distributed::Options().data_parallel(d).shard_optimizer_state(true), or use an "
                "unsharded optimizer");
    s.replicas = replicas();
    s.replica = replica();
    for (const auto& p : named_parameters(/*recurse=*/true)) {
      s.parameters.push_back(p.value());
      s.names.push_back(p.key());
      s.owned.push_back(p.value().requires_grad() && replicas_.owns(p.value()) ? 1 : 0);
    }
    s.send_updated = [this] { replicas_.send_updated(); };
    s.attach_sender = [this] { replicas_.attach_sender(); };
    s.sum_found_inf = found_inf_reduction();
    s.norms = [this, params = s.parameters](const std::vector<torch::Tensor>& mine, double max_norm,
                                            double norm_type) {
      auto gather = [this](const std::string& what, const torch::Tensor& values) {
        return runtime::gather_values(*transport_, who_ + "::" + what, values);
      };
      return ::stagewise::detail::stage_norm_gather(transport_->processes(), stages_, params,
                                                    gather, max_norm, norm_type,
                                                    who_ + "::clip_grad_norm_")(mine);
    };
    return s;
  }

  /// With `Options().shard_optimizer_state(true)`: waits until every stage here holds its
  /// owners' updates of the last step. Each stage's next forward, `save` and `load` wait for them
  /// themselves; call it before reading the parameters otherwise (evaluating, printing).
  void wait_parameters() { replicas_.wait_parameters(-1); }

  /// Which rank runs which stages of which replica, and which ranks give the input and the
  /// target, one line per rank (every rank returns the whole layout).
  ///   if (pipe->rank() == 0) std::cout << pipe->layout();
  std::string layout() const {
    std::ostringstream out;
    const int d = replicas();
    out << "stagewise::distributed::Pipe: " << num_stages() << " stages on " << workers_
        << (workers_ == 1 ? " rank" : " ranks") << " per replica x " << d
        << (d == 1 ? " replica" : " replicas") << " = " << world_size() << " ranks\n";
    for (int r = 0; r < world_size(); ++r) {
      const int p = r % workers_;
      out << "rank " << r << ": replica " << r / workers_ << ", stages";
      for (int j = 0; j < num_stages(); ++j) {
        if (rank_of(j) == p) out << " " << j;
      }
      if (p == rank_of(0)) out << "; gives the input";
      if (p == rank_of(num_stages() - 1)) out << "; gives the target";
      if (d > 1) {
        out << "; rows [" << r / workers_ << "/" << d << ", " << r / workers_ + 1 << "/" << d
            << ") of each global batch (shard)";
      }
      out << "\n";
    }
    return out.str();
  }
  /// Train or eval mode for this rank's stages (checkpointing runs only in training). Moving
  /// the pipe with to(device) is refused (PlacedStages); to(dtype) is allowed.
  void train(bool on = true) override { torch::nn::Module::train(on); }

 protected:
  /// A GradScaler's inf/NaN check summed over the whole job, every stage and replica: one
  /// all-reduce on the job's process group (not the store), waited for as the transport waits,
  /// so a rank that fails fails it on every rank. Through the transport's gather where the
  /// job's connection has no collectives (a Connection built by hand).
  ::stagewise::detail::FoundInfReduction found_inf_reduction() override {
    if (!job_.collectives) return PipeOverImpl::found_inf_reduction();
    return [this](const torch::Tensor& found) {
      std::vector<at::Tensor> one{found.to(dist_.transport().device(), torch::kFloat,
                                           /*non_blocking=*/false, /*copy=*/true)};
      std::vector<int> members(static_cast<std::size_t>(world_size()));
      std::iota(members.begin(), members.end(), 0);
      transport_->wait_collective(job_.collectives.all_reduce_sum(one), members,
                                  "the GradScaler's inf/NaN check (an all-reduce)");
      return one.front();
    };
  }

 private:
  // What the checks before the transport find: this rank's stages' specs, every stage's rank
  // within a replica, this replica's and this rank's column's groups, and the transport over
  // this replica's ranks (which owns which rank runs which stage).
  struct Prepared {
    std::optional<runtime::Connection> job;
    ::stagewise::detail::ResolvedPipe resolved;  // the options resolved, and the stages
    std::vector<int> placement;
    int workers = 1;
    std::optional<runtime::Connection> row;  // this replica's ranks (the job with one replica)
    std::unique_ptr<runtime::Connection> column;  // data parallel: this stage rank in each replica
    std::unique_ptr<runtime::C10dTransport> transport;
  };

  PipeImpl(Prepared p, const PipeOptions& options, const Options& dist)
      : PipeOverImpl("stagewise::distributed::Pipe", options, std::move(p.transport)),
        job_(std::move(*p.job)),
        dist_(dist),
        workers_(p.workers),
        placement_(std::move(p.placement)) {
    set_placement_fix("build the pipe with Options().placed_like(schedule) for a V-shaped "
                      "schedule or Options().virtual_stages(v) for v stages per rank (now " +
                      std::to_string(dist_.virtual_stages()) +
                      "), or pass a schedule that places stage j on rank j % " +
                      std::to_string(workers_));
    build(std::move(p.resolved));
    if (p.column) {
      replicas_ = detail::ReplicaGradients(
          std::move(*p.column), dist_.data_parallel(), stages_, transport_.get(), dist_.reducer(),
          dist_.transport().device(), where_, dist_.transport().prefix() + "/shard",
          dist_.connect().timeout);
    }
  }

  // Checks the job before anything is built: the options, the ranks' number, their wire formats
  // and models; then joins the replicas' groups and builds the transport.
  static Prepared prepare(runtime::Connection job, const torch::nn::Sequential& seq,
                          const balance& b, const PipeOptions& options, const Options& dist) {
    const int d = dist.data_parallel();
    TORCH_CHECK(!dist.shard_optimizer_state() || d > 1,
                "stagewise::distributed::Pipe: Options().shard_optimizer_state(true) shards each "
                "stage's optimizer state over its data-parallel replicas, but the pipe has one "
                "(data_parallel(1)); set data_parallel(d) with d > 1, or leave it off");
    Prepared p;
    p.resolved = ::stagewise::detail::resolve_pipe(
        options,
        {.who = "stagewise::distributed::Pipe",
         .processes = job.env.world_size,
         .rank = job.env.rank,
         .replicas = d,
         .places_ranks = true,
         .virtual_stages = dist.virtual_stages(),
         .placement = dist.placement()},
        seq, b);
    p.placement = p.resolved.options.placement;
    const int n = static_cast<int>(p.resolved.specs.size());
    p.workers = *std::max_element(p.placement.begin(), p.placement.end()) + 1;
    if (d == 1) {
      runtime::check_world_size(job, n, p.workers);
    } else {
      TORCH_CHECK(job.env.world_size == p.workers * d,
                  "stagewise::distributed::Pipe: the pipe has ", n, " stages on ", p.workers,
                  " ranks per replica and Options::data_parallel(", d, ") replicas, so it runs on ",
                  p.workers * d, " ranks, but WORLD_SIZE is ", job.env.world_size, "; start ",
                  p.workers * d, " ranks (tools/launch -n ", p.workers * d,
                  "), or change data_parallel, the balance or the virtual stages");
    }
    std::vector<std::string> signatures;
    for (const auto& spec : p.resolved.specs) {
      signatures.push_back(spec.module ? runtime::stage_signature(*spec.module) : "");
    }
    // Every rank of every replica speaks the same wire format and built the same model.
    runtime::check_same_wire(job, runtime::wire_format(dist.transport()),
                             dist.transport().prefix() + "/wire", dist.connect().timeout);
    runtime::check_same_model(job, signatures, dist.transport().prefix() + "/model",
                              dist.connect().timeout);
    p.row = job;
    if (d > 1) {
      // This replica's group (its pipeline messages) and the group of this rank's counterparts
      // in every replica (the reductions; its rank r is replica r).
      const int replica = job.env.rank / p.workers, pipeline_rank = job.env.rank % p.workers;
      const auto& prefix = dist.transport().prefix();
      std::vector<int> row, column;
      for (int q = 0; q < p.workers; ++q) row.push_back(replica * p.workers + q);
      for (int i = 0; i < d; ++i) column.push_back(i * p.workers + pipeline_rank);
      p.row = runtime::subgroup(job, row, prefix + "/replica" + std::to_string(replica),
                                dist.connect());
      p.column = std::make_unique<runtime::Connection>(runtime::subgroup(
          job, column, prefix + "/stage_rank" + std::to_string(pipeline_rank), dist.connect()));
    }
    p.transport = std::make_unique<runtime::C10dTransport>(*p.row, p.placement, dist.transport());
    p.job = std::move(job);
    return p;
  }

  friend class Pipe;
  std::optional<PipelinePlan> plan_;  // built from a plan: the one every rank agreed on
  runtime::Connection job_;  // every rank of every replica
  Options dist_;
  int workers_ = 1;
  std::vector<int> placement_;  // the rank, within a replica, of every stage
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
  /// The pipeline `plan` describes: its split, micro-batches, checkpoint modes, offloads, the
  /// schedule `train_step` runs (whose placement puts the stages on ranks), and its replicas and
  /// their sharding (`data_parallel(d)`, `shard_optimizer_state`, `shard_gradients`, taken from
  /// the plan unless `dist` sets them: then they must be the plan's). A plan for the job's ranks
  /// (`PlanOptions().ranks(N)`, given the global batch) is built on exactly N ranks as K ranks
  /// per pipeline x d replicas; a plan for `workers(K)` (with a replica's rows) on K x
  /// `dist.data_parallel()` ranks. Every rank runs rank 0's plan (each plans on its own
  /// profiles; where two candidates are close, ranks may choose differently; `plan()` says
  /// which). Rendezvouses from the environment.
  ///   sw::distributed::Pipe pipe(model, sw::plan_pipeline(model, x, y, loss_fn, options));
  Pipe(const torch::nn::Sequential& seq, const PipelinePlan& plan, Options dist = {})
      : Pipe(runtime::connect(runtime::rendezvous_env(), dist.connect()), seq, plan, dist) {}
  /// The same over a job the caller already joined.
  Pipe(runtime::Connection connection, const torch::nn::Sequential& seq, const PipelinePlan& plan,
       Options dist = {})
      : Pipe(connection, seq,
             detail::agreed_plan(connection, plan, dist.transport().prefix() + "/plan",
                                 dist.connect().timeout),
             dist, 0) {}

 private:
  // `dist` with the plan's replicas and sharding when it sets none, after checking that a plan
  // for N ranks runs on N.
  static Options as_planned(const PipelinePlan& plan, Options dist,
                            const runtime::Connection& job) {
    const int world = job.env.world_size;
    TORCH_CHECK(plan.ranks <= 0 || plan.ranks == world,
                "stagewise::distributed::Pipe: the plan is for a job of ", plan.ranks, " ranks (",
                plan.workers, " per pipeline x ", plan.replicas, " replicas) but this job has ",
                world, "; plan for it with PlanOptions().ranks(", world, ")");
    if (dist.data_parallel() == 1 && !dist.shard_optimizer_state()) {
      dist.data_parallel(plan.replicas)
          .shard_optimizer_state(plan.shard_optimizer_state)
          .shard_gradients(plan.shard_gradients);
    }
    counted_as_built(plan, dist);
    return dist;
  }

  // The replicas and sharding the plan counted memory for (`PlanOptions().replicas(d)`) are the
  // pipe's: a plan for sharded replicas would not fit unsharded ones. A plan that counted none
  // (replicas 1, the planner's default) is a replica's plan that leaves out what replicas add.
  static const PipelinePlan& counted_as_built(const PipelinePlan& plan, const Options& dist) {
    if (plan.replicas == 1 && !plan.shard_optimizer_state) return plan;
    auto describe = [](int d, bool state, bool grads) {
      std::string s = "data_parallel(" + std::to_string(d) + ")";
      if (grads) return s + ".shard_gradients(true)";
      if (state) return s + ".shard_optimizer_state(true)";
      return s;
    };
    const auto planned = describe(plan.replicas, plan.shard_optimizer_state, plan.shard_gradients);
    const auto built =
        describe(dist.data_parallel(), dist.shard_optimizer_state(), dist.shard_gradients());
    TORCH_CHECK(planned == built,
                "stagewise::distributed::Pipe: the plan counts each worker's "
                "memory for ",
                planned,
                " (PlanOptions().replicas and sharding) but the pipe is "
                "built with ",
                built, "; build it with distributed::Options().", planned,
                ", or plan for the pipe you build");
    return plan;
  }

  Pipe(const runtime::Connection& connection, const torch::nn::Sequential& seq,
       const PipelinePlan& agreed, const Options& dist, int)
      : Pipe(connection, seq, agreed.split, agreed.options(), as_planned(agreed, dist, connection)) {
    get()->plan_ = agreed;
  }
};

}  // namespace stagewise::distributed
