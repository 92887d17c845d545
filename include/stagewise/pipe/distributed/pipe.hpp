#pragma once

#include "stagewise/pipe/detail/pipe_over.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
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
        connection_(std::move(connection)),
        dist_(std::move(dist)) {
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
    std::vector<std::string> signatures;
    for (const auto& spec : specs) {
      signatures.push_back(spec.module ? runtime::stage_signature(*spec.module) : "");
    }
    runtime::check_same_model(connection_, signatures, dist_.transport().prefix() + "/model",
                              dist_.connect().timeout);
    build_stages(std::move(specs),
                 [&](std::size_t j) { return rank_of(static_cast<int>(j)) == rank(); });
    set_transport(std::make_unique<runtime::C10dTransport>(
        connection_,
        [placement = placement_](int stage) { return placement[static_cast<std::size_t>(stage)]; },
        skips_->stage_routes(), dist_.transport()));
  }

  // train_step (four overloads; every rank calls it), options(), skip_layout() and traffic()
  // (the messages and tensor bytes this rank exchanged with the others since the pipe was built;
  // messages between this rank's own stages move nothing and are not counted): PipeOver, the
  // step both pipes share.

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
  /// Train or eval mode for this rank's stages (checkpointing runs only in training). Moving
  /// the pipe with to(device) is refused (PlacedStages); to(dtype) is allowed.
  void train(bool on = true) override { torch::nn::Module::train(on); }

 private:
  int process_rank() const override { return rank(); }
  int process_count() const override { return world_size(); }
  int process_of(int stage) const override { return rank_of(stage); }
  // Through the job's store, under a key of this pipe's (every rank makes the same calls).
  std::vector<std::string> gather(const std::string& what, const std::string& mine) override {
    return runtime::gather_text(
        connection_, dist_.transport().prefix() + "/gather/" + std::to_string(++gathers_), mine,
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

  runtime::Connection connection_;
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
