#pragma once

#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/options.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"
#include "stagewise/schedule/concepts.hpp"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <functional>
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
  /// Shards each stage's optimizer state over its replicas (ZeRO): every parameter of a stage is
  /// owned by one of the stage's d replicas (whole tensors balanced by size); after the stage's
  /// last backward of a step its gradients are reduce-scattered bucket by bucket, so each
  /// replica receives the averages of its own parameters only, and the local gradients are freed
  /// as each bucket leaves; the optimizer (`distributed::Sharded<torch::optim::Adam>` over
  /// `pipe`, or the fused step of `train_step`) steps the owned parameters, whose new values then
  /// travel to the other replicas, each waiting for them before its stage's next forward. Needs
  /// `data_parallel(d)` with d > 1. See docs/distributed.md, "Sharded state".
  ///   stagewise::distributed::Options().data_parallel(2).shard_optimizer_state(true)
  Options& shard_optimizer_state(bool on) {
    reducer_.shard = on;
    if (!on) reducer_.reduce_each_pass = false;
    return *this;
  }
  /// Shards the gradients during a step's accumulation too (ZeRO-2; implies
  /// `shard_optimizer_state`): each micro-batch's backward reduce-scatters its gradients bucket
  /// by bucket as they arrive and frees them, each owner adding up its averages over the
  /// micro-batches, so a rank holds its shard of the gradients and a bucket or two in flight
  /// instead of the whole stage's. A micro-batch's worth of communication per micro-batch (M
  /// reduce-scatters a step instead of one); the sums come in another order than unsharded
  /// (rounding differs, about 1e-7 relative). See docs/distributed.md, "Sharded state".
  ///   stagewise::distributed::Options().data_parallel(2).shard_gradients(true)
  Options& shard_gradients(bool on) {
    reducer_.reduce_each_pass = on;
    if (on) reducer_.shard = true;
    return *this;
  }
  /// How sharded gradients reach their owners (default `runtime::ReduceScatter::reduce`).
  Options& reduce_scatter(runtime::ReduceScatter how) {
    reducer_.reduce_scatter = how;
    return *this;
  }

  /// What the setters above set, read back (as `PipeOptions`' getters are).
  int data_parallel() const { return replicas_; }
  bool shard_optimizer_state() const { return reducer_.shard; }
  bool shard_gradients() const { return reducer_.reduce_each_pass; }
  runtime::ReduceScatter reduce_scatter() const { return reducer_.reduce_scatter; }
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

}  // namespace stagewise::distributed
