#pragma once

#include "stagewise/pipe/detail/pipe_over.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/gradient_reducer.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/c10d/subgroup.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
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
#include <sstream>
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

  /// Runs `d` replicas of the pipeline (data parallel × pipeline parallel) on K·d ranks, K ranks
  /// per replica: rank r is rank r % K of replica r / K (replica-major). Each replica trains on
  /// its own rows of the global batch (`PipeImpl::shard`); after a stage's last backward of a
  /// step, its replicas average its gradients over their own group (in buckets, while the other
  /// stages still compute), and the loss returned is the mean over the whole global batch.
  /// Default 1: one replica on K ranks.
  ///   stagewise::distributed::Options().data_parallel(2)  // tools/launch -n 4 for 2 stages
  Options& data_parallel(int d) {
    TORCH_CHECK(d >= 1, "stagewise::distributed::Options::data_parallel: ", d,
                " replicas; give 1 or more");
    replicas_ = d;
    return *this;
  }
  /// Bytes of gradients per all-reduce between replicas (default 25 MiB; see DataParallel).
  Options& bucket_bytes(std::int64_t b) {
    reducer_.bucket_bytes = b;
    return *this;
  }
  /// Lets a stage's parameter get a gradient in some replicas and not others (the others add
  /// zeros); otherwise such a step is an error naming it. See DataParallelOptions.
  Options& unused_parameters(bool on) {
    reducer_.unused_parameters = on;
    return *this;
  }

  /// What the setters above set, read back (as `PipeOptions`' getters are).
  int data_parallel() const { return replicas_; }
  const runtime::ReducerOptions& reducer() const { return reducer_; }
  int virtual_stages() const { return virtual_stages_; }
  /// Every stage's rank for a number of stages (`placed_like`); null: stage j on rank
  /// j % (stages / v).
  const std::function<std::vector<int>(int)>& placement() const { return placement_; }
  const runtime::C10dOptions& transport() const { return transport_; }
  /// The rendezvous options (`backend`, `timeout`).
  const runtime::ConnectOptions& connect() const { return connect_; }

 private:
  int virtual_stages_ = 1;
  int replicas_ = 1;
  runtime::ReducerOptions reducer_{.who = "stagewise::distributed::Pipe",
                                   .from_backward = false,
                                   .unused_fix = "distributed::Options().unused_parameters(true)"};
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
class PipeImpl : public ::stagewise::detail::PipeOver<runtime::C10dTransport> {
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
      : PipeOver("stagewise::distributed::Pipe", std::move(options)),
        job_(std::move(connection)),
        connection_(job_),
        dist_(std::move(dist)) {
    TORCH_CHECK(!options_.deferred_batch_norm() || dist_.data_parallel() == 1,
                "stagewise::distributed::Pipe: PipeOptions().deferred_batch_norm(true) with "
                "Options().data_parallel(", dist_.data_parallel(),
                "): each replica would keep running statistics of its own rows only, and the "
                "replicas' would drift apart; turn one of them off (plain batch norm, or one "
                "replica)");
    auto specs = ::stagewise::detail::partition(
        ::stagewise::detail::with_deferred_batch_norm(seq, options_), b);
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
    const int d = dist_.data_parallel();
    if (d == 1) {
      runtime::check_world_size(job_, n, workers_);
    } else {
      TORCH_CHECK(job_.env.world_size == workers_ * d,
                  "stagewise::distributed::Pipe: the pipe has ", n, " stages on ", workers_,
                  " ranks per replica and Options::data_parallel(", d, ") replicas, so it runs on ",
                  workers_ * d, " ranks, but WORLD_SIZE is ", job_.env.world_size, "; start ",
                  workers_ * d, " ranks (tools/launch -n ", workers_ * d,
                  "), or change data_parallel, the balance or the virtual stages");
    }
    std::vector<std::string> signatures;
    for (const auto& spec : specs) {
      signatures.push_back(spec.module ? runtime::stage_signature(*spec.module) : "");
    }
    // Every rank of every replica speaks the same wire format and built the same model.
    runtime::check_same_wire(job_, runtime::wire_format(dist_.transport()),
                             dist_.transport().prefix() + "/wire", dist_.connect().timeout);
    runtime::check_same_model(job_, signatures, dist_.transport().prefix() + "/model",
                              dist_.connect().timeout);
    if (d > 1) join_replicas();
    build_stages(std::move(specs),
                 [&](std::size_t j) { return rank_of(static_cast<int>(j)) == pipeline_rank(); });
    if (d > 1) make_reducers();
    set_transport(std::make_unique<runtime::C10dTransport>(
        connection_,
        [placement = placement_](int stage) { return placement[static_cast<std::size_t>(stage)]; },
        skips_->stage_routes(), dist_.transport()));
  }

  // train_step (four overloads; every rank calls it), options(), skip_layout() and traffic()
  // (the messages and tensor bytes this rank exchanged with the others since the pipe was built;
  // messages between this rank's own stages move nothing and are not counted): PipeOver, the
  // step both pipes share.

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
    std::int64_t bytes = 0;
    for (const auto& r : reducers_) {
      if (r) bytes += r->bytes_last_step();
    }
    return bytes;
  }

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

 private:
  int process_rank() const override { return rank(); }
  int process_count() const override { return world_size(); }
  int process_of(int stage) const override { return replica() * workers_ + rank_of(stage); }
  bool writes_stage_files() const override { return replica() == 0; }
  // Through the job's store, under a key of this pipe's (every rank makes the same calls).
  std::vector<std::string> gather(const std::string& what, const std::string& mine) override {
    return runtime::gather_text(
        job_, dist_.transport().prefix() + "/gather/" + std::to_string(++gathers_), mine,
        dist_.connect().timeout, "stagewise::distributed::Pipe::" + what);
  }

  // The schedule must run stage j on rank_of(j), on as many workers as there are ranks.
  void check_placement(const std::vector<int>& placement, int workers) const override {
    TORCH_CHECK(workers == workers_, "stagewise::distributed::Pipe::train_step: the schedule runs ",
                "the ", placement.size(), " stages on ", workers,
                " workers but the pipe was built for ", workers_,
                " ranks (Options::virtual_stages ", dist_.virtual_stages(),
                "); build the pipe with the schedule's stages per rank");
    for (int j = 0; j < num_stages(); ++j) {
      TORCH_CHECK(placement[static_cast<std::size_t>(j)] == rank_of(j),
                  "stagewise::distributed::Pipe::train_step: the schedule runs stage ", j,
                  " on worker ", placement[static_cast<std::size_t>(j)],
                  " but the pipe keeps it on rank ", rank_of(j),
                  "; build the pipe with Options().placed_like(schedule) for a V-shaped schedule, "
                  "or pass a schedule that places stage j on rank j % ",
                  workers_);
    }
  }

  // Data parallel: this rank's replica's group (its pipeline messages), the group of this rank's
  // counterparts in every replica (the reductions; its rank r is replica r), parameters and
  // buffers copied from replica 0, and a reducer per local stage with gradients.
  void join_replicas() {
    const int d = replicas();
    const auto& prefix = dist_.transport().prefix();
    std::vector<int> row, column;
    for (int p = 0; p < workers_; ++p) row.push_back(replica() * workers_ + p);
    for (int i = 0; i < d; ++i) column.push_back(i * workers_ + pipeline_rank());
    connection_ = runtime::subgroup(job_, row, prefix + "/replica" + std::to_string(replica()),
                                    dist_.connect());
    column_ = std::make_unique<runtime::Connection>(runtime::subgroup(
        job_, column, prefix + "/stage_rank" + std::to_string(pipeline_rank()), dist_.connect()));
    TORCH_CHECK(static_cast<bool>(column_->collectives),
                "stagewise::distributed::Pipe: the process group has no collectives");
  }

  void make_reducers() {
    torch::NoGradGuard no_grad;
    reducers_.resize(stages_.size());
    for (std::size_t j = 0; j < stages_.size(); ++j) {
      if (!stages_[j] || !stages_[j]->spec.module) continue;
      auto& module = *stages_[j]->spec.module;
      // Replica 0's parameters and buffers everywhere, so that the replicas start alike.
      std::vector<at::Tensor> all = module.parameters(/*recurse=*/true);
      for (const auto& b : module.buffers(/*recurse=*/true)) {
        if (b.defined()) all.push_back(b);
      }
      runtime::broadcast_each(column_->collectives, all, /*root=*/0);
      std::vector<torch::Tensor> params;
      std::vector<std::string> names;
      for (const auto& p : module.named_parameters(/*recurse=*/true)) {
        if (!p.value().requires_grad()) continue;
        params.push_back(p.value());
        names.push_back("stage" + std::to_string(j) + "." + p.key());
      }
      if (params.empty()) continue;
      reducers_[j] = std::make_unique<runtime::GradientReducer>(
          column_->collectives, std::move(params), std::move(names), dist_.reducer());
    }
  }

  bool reduces_gradients() const override { return replicas() > 1; }

  // On stage j's worker, after its last backward: its gradients start travelling.
  void gradients_ready(int j) override {
    if (auto& r = reducers_[static_cast<std::size_t>(j)]) r->launch();
  }

  // The replicas' mean loss over their rows (checked equal), then the stages' averaged gradients.
  torch::Tensor finish_gradients(const torch::Tensor& loss, std::int64_t rows) override {
    auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
      transport_->wait_collective(w, column_->job_ranks, what);
    };
    const double r = static_cast<double>(rows);
    // On the transport's device: NCCL reduces only GPU tensors (Gloo takes either).
    auto sums =
        torch::tensor({loss.detach().to(torch::kCPU, torch::kDouble).item<double>() * r, r, r * r},
                      torch::kDouble)
            .to(dist_.transport().device());
    std::vector<at::Tensor> one{sums};
    wait(column_->collectives.all_reduce_sum(one), "the replicas' sum of the loss");
    sums = sums.to(torch::kCPU);
    const auto* s = sums.data_ptr<double>();
    const int d = replicas();
    // d * sum(r^2) == sum(r)^2 exactly when every replica had the same number of rows.
    TORCH_CHECK(static_cast<double>(d) * s[2] == s[1] * s[1], where_, ": the ", d,
                " replicas were given different numbers of rows (", s[1], " in all, this replica ",
                r,
                "), so averaging their gradients would weight rows unequally; give every replica "
                "the same number of rows (pipe->shard(global_batch))");
    for (std::size_t j = 0; j < reducers_.size(); ++j) {
      if (!reducers_[j]) continue;
      reducers_[j]->complete([&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
        wait(w, what + " of stage " + std::to_string(j));
      });
    }
    return torch::full({}, s[0] / s[1], loss.options());
  }

  void step_after_reduction(optim::FusedStep* fused) override {
    for (auto& reducer : reducers_) {
      if (!reducer) continue;
      if (fused == nullptr) {
        reducer->set_after_reduce(nullptr);
        continue;
      }
      std::vector<std::size_t> slot;
      for (const auto& p : reducer->parameters()) {
        slot.push_back(fused->index_of(p, "distributed::Pipe::train_step"));
      }
      reducer->set_after_reduce(
          [fused, slot = std::move(slot)](std::size_t i) { fused->step_parameter(slot[i]); });
    }
  }

  runtime::Connection job_;                      // every rank of every replica
  runtime::Connection connection_;               // this replica's ranks (the job with one replica)
  std::unique_ptr<runtime::Connection> column_;  // data parallel: this stage rank in each replica
  std::vector<std::unique_ptr<runtime::GradientReducer>> reducers_;  // per stage; null: none
  Options dist_;
  int workers_ = 1;
  std::vector<int> placement_;  // the rank of every stage
  std::int64_t gathers_ = 0;    // exchanges through the store so far (saves, loads)
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
