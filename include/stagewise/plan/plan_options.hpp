#pragma once

#include "stagewise/plan/link_speed.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/any_schedule.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stagewise {

/// Adam's (or AdamW's) state for `plan_pipeline`: two tensors per parameter (first and second
/// moments), and about two parameters' worth of temporaries while one parameter steps.
struct AdamState {
  double lr = 1e-3;
  double weight_decay = 0;
};

/// SGD's state: one tensor per parameter with momentum, none without.
struct SGDState {
  double lr = 0.1;
  double momentum = 0;
};

/// What `plan_pipeline` weighs a candidate by: the fastest step that fits (`time`, the default),
/// or the smallest peak that fits (`memory`; ties go to the faster).
enum class PlanFor { time, memory };

/// The question `plan_pipeline` answers, as chained setters: how many workers (devices, or ranks
/// of a distributed pipe), how many bytes each may hold in all (parameters, gradients, optimizer
/// state, activations, working memory), the optimizer, an optional store to offload to, and
/// optionally the candidates to weigh (schedules by name, micro-batch counts).
///   sw::PlanOptions().workers(4).memory_per_worker(6LL << 30).optimizer(sw::AdamState{})
///       .store(sw::runtime::HostStore())
class PlanOptions {
 public:
  /// Workers: devices, or ranks of a distributed pipe (default 2).
  PlanOptions& workers(int n) {
    TORCH_CHECK(n >= 1, "stagewise::PlanOptions: workers is ", n, "; give 1 or more");
    workers_ = n;
    return *this;
  }
  /// The bytes each worker may hold in all (required): its stages' parameters, their gradients,
  /// the optimizer's state, the activations its cells keep, and its largest action's working
  /// memory.
  PlanOptions& memory_per_worker(std::int64_t bytes) {
    TORCH_CHECK(bytes > 0, "stagewise::PlanOptions: memory_per_worker is ", bytes,
                " bytes; give the bytes one worker (device) may hold");
    cap_ = bytes;
    return *this;
  }
  /// The optimizer (default AdamState{}): its state's bytes and its step's time count.
  PlanOptions& optimizer(AdamState s) {
    optimizer_name_ = "adam";
    state_per_param_ = 2.0;
    step_temporaries_ = 2.0;
    adam_ = s;
    sgd_.reset();
    return *this;
  }
  PlanOptions& optimizer(SGDState s) {
    optimizer_name_ = s.momentum != 0 ? "sgd with momentum" : "sgd";
    state_per_param_ = s.momentum != 0 ? 1.0 : 0.0;
    step_temporaries_ = 1.0;
    sgd_ = s;
    adam_.reset();
    return *this;
  }
  /// A store checkpointed cells may offload to (default none), and its copy speed in bytes per
  /// second each way (default 4 GB/s; a file store on a disk is slower).
  PlanOptions& store(runtime::AnyStore s, double bytes_per_second = 4e9) {
    TORCH_CHECK(bytes_per_second > 0, "stagewise::PlanOptions: the store's speed is ",
                bytes_per_second, " bytes per second; give a positive speed");
    store_ = std::move(s);
    store_speed_ = bytes_per_second;
    return *this;
  }
  /// A store the optimizer's state may go to (default none: it stays on the device), and its
  /// speed in bytes per second (default 4 GB/s): each candidate is then weighed with none, half
  /// and all of each stage's state there (whole tensors, largest first), its host steps timed
  /// once on the CPU, and the chosen plan's pipe keeps it there
  /// (`PipeOptions().optimizer_offload`). May be the activations' `store` too.
  ///   sw::PlanOptions().workers(4).memory_per_worker(cap).optimizer_store(sw::runtime::HostStore())
  PlanOptions& optimizer_store(runtime::AnyStore s, double bytes_per_second = 4e9) {
    TORCH_CHECK(bytes_per_second > 0, "stagewise::PlanOptions: the optimizer store's speed is ",
                bytes_per_second, " bytes per second; give a positive speed");
    TORCH_CHECK(s.keeps_state(), "stagewise::PlanOptions: optimizer_store: ", s.describe(),
                " keeps no optimizer state (it is not a runtime::state_store); give a HostStore "
                "or a FileStore");
    optimizer_store_ = std::move(s);
    optimizer_store_speed_ = bytes_per_second;
    return *this;
  }
  /// The schedules to weigh, by name (default: every built-in one; see schedule::default_candidates).
  PlanOptions& schedules(std::vector<std::string> names) {
    TORCH_CHECK(!names.empty(), "stagewise::PlanOptions: schedules is empty; leave it out to "
                "weigh every built-in schedule");
    schedules_ = std::move(names);
    return *this;
  }
  /// The micro-batch counts to weigh (default: every divisor of the batch's rows up to 64).
  PlanOptions& micro_batches(std::vector<int> counts) {
    for (int m : counts) {
      TORCH_CHECK(m >= 1, "stagewise::PlanOptions: micro_batches holds ", m,
                  "; give counts of 1 or more");
    }
    TORCH_CHECK(!counts.empty(), "stagewise::PlanOptions: micro_batches is empty; leave it out "
                "to weigh every divisor of the batch");
    micro_batches_ = std::move(counts);
    return *this;
  }
  /// Weigh only a fused (true) or only an unfused (false) optimizer step (default: both).
  PlanOptions& fused_step(bool on) {
    fused_ = on;
    return *this;
  }
  /// The share of the cap a plan leaves free for what the model does not see (allocator slack,
  /// small tensors, a caching allocator's rounding; default 0.05, and 0.1 with `ranks(N)`, where
  /// the model has been seen up to 11% under a rank's measured peak under ZB-H1): a plan's
  /// predicted peak is at most (1 - headroom) times the cap.
  PlanOptions& headroom(double share) {
    TORCH_CHECK(share >= 0 && share < 1, "stagewise::PlanOptions: headroom is ", share,
                "; give a share of the cap from 0 to below 1 (0.05: 5%)");
    headroom_ = share;
    return *this;
  }
  /// Whether the stages run on separate devices or ranks (default false: one process on one
  /// device, where a stage's output is the next stage's input, one tensor charged to the stage
  /// that made it). Apart, each stage holds a copy of its input.
  PlanOptions& separate_devices(bool on) {
    separate_devices_ = on;
    return *this;
  }
  /// Data-parallel replicas of the pipeline (default 1): the plan is for one replica of a 2-D
  /// pipe (`distributed::Options().data_parallel(d)`), `workers` ranks each, planned on a
  /// replica's rows. Each worker then also holds its stages' reduction buckets, or, with
  /// `shard_optimizer_state` / `shard_gradients`, only its shard of the optimizer state (and of
  /// the gradients); and the fused step runs at the end of the step, after the reduction
  /// (`schedule::replica_state`).
  ///   sw::PlanOptions().workers(2).replicas(2).shard_gradients(true)
  PlanOptions& replicas(int d) {
    TORCH_CHECK(d >= 1, "stagewise::PlanOptions: replicas is ", d, "; give 1 or more");
    replicas_ = d;
    return *this;
  }
  /// With replicas: each stage's optimizer state sharded over them (ZeRO-1), as
  /// `distributed::Options().shard_optimizer_state(true)` builds it.
  PlanOptions& shard_optimizer_state(bool on) {
    shard_state_ = on;
    if (!on) shard_gradients_ = false;
    return *this;
  }
  /// With replicas: the gradients sharded too (ZeRO-2), as
  /// `distributed::Options().shard_gradients(true)` builds it.
  PlanOptions& shard_gradients(bool on) {
    shard_gradients_ = on;
    if (on) shard_state_ = true;
    return *this;
  }
  /// The reducer's bucket size the plan counts (default 25 MiB, as distributed::Options).
  PlanOptions& bucket_bytes(std::int64_t b) {
    TORCH_CHECK(b > 0, "stagewise::PlanOptions: bucket_bytes is ", b, "; give a positive size");
    bucket_bytes_ = b;
    return *this;
  }
  /// Plans for `n` ranks of a distributed job (default 0: plan `workers` of one replica): every
  /// factorisation n = K x d is weighed, K ranks per replica's pipeline and d replicas on
  /// 1/d of the batch's rows each (a d that does not divide the rows is skipped, said in the
  /// report), with all that is weighed for K workers (split, schedule, micro-batches, checkpoint
  /// and offload per stage, the fused step, optimizer state off the device) and, for d > 1, the
  /// optimizer state unsharded, sharded (ZeRO-1) and with the gradients sharded (ZeRO-2); each
  /// candidate's step includes the replicas' gradient exchange over `link`, which d > 1 needs.
  /// The stages count as on separate ranks (`separate_devices`), the cap is per rank. Give the
  /// global batch; `distributed::Pipe(model, plan)` builds the chosen K x d pipe on the job.
  /// Overrides `workers`; `replicas` and the sharding setters are refused with it.
  ///   sw::PlanOptions().ranks(4).memory_per_worker(cap).link(sw::distributed::measure_link(job))
  PlanOptions& ranks(int n) {
    TORCH_CHECK(n >= 1, "stagewise::PlanOptions: ranks is ", n, "; give the job's ranks (1 or more)");
    ranks_ = n;
    return *this;
  }
  /// The speed of the job's links, for the replicas' gradient exchange (`ranks`): given, or
  /// measured over the job by `distributed::measure_link(job)`.
  ///   sw::PlanOptions().ranks(4).link(sw::LinkSpeed{.latency_seconds = 50e-6, .bytes_per_second = 2e9})
  PlanOptions& link(LinkSpeed l) {
    l.check("stagewise::PlanOptions::link");
    link_ = l;
    return *this;
  }
  /// Fastest first (default) or smallest first.
  PlanOptions& prefer(PlanFor p) {
    prefer_ = p;
    return *this;
  }
  /// Where stages are profiled (default: where the model is).
  PlanOptions& device(torch::Device d) {
    device_ = d;
    return *this;
  }
  /// Timed profiling rounds (default 2, after an untimed one).
  PlanOptions& rounds(int n) {
    TORCH_CHECK(n >= 1, "stagewise::PlanOptions: rounds is ", n, "; give 1 or more");
    rounds_ = n;
    return *this;
  }

  int workers() const { return workers_; }
  std::int64_t memory_per_worker() const { return cap_; }
  const std::string& optimizer_name() const { return optimizer_name_; }
  double state_per_param() const { return state_per_param_; }
  double step_temporaries() const { return step_temporaries_; }
  const std::optional<AdamState>& adam() const { return adam_; }
  const std::optional<SGDState>& sgd() const { return sgd_; }
  const std::optional<runtime::AnyStore>& store() const { return store_; }
  double store_speed() const { return store_speed_; }
  const std::optional<runtime::AnyStore>& optimizer_store() const { return optimizer_store_; }
  double optimizer_store_speed() const { return optimizer_store_speed_; }
  const std::vector<std::string>& schedules() const { return schedules_; }
  const std::vector<int>& micro_batches() const { return micro_batches_; }
  const std::optional<bool>& fused_step() const { return fused_; }
  PlanFor prefer() const { return prefer_; }
  const std::optional<torch::Device>& device() const { return device_; }
  int rounds() const { return rounds_; }
  double headroom() const { return headroom_.value_or(ranks_ > 0 ? 0.1 : 0.05); }
  bool separate_devices() const { return separate_devices_; }
  int replicas() const { return replicas_; }
  bool shard_optimizer_state() const { return shard_state_; }
  bool shard_gradients() const { return shard_gradients_; }
  std::int64_t bucket_bytes() const { return bucket_bytes_; }
  int ranks() const { return ranks_; }
  const std::optional<LinkSpeed>& link() const { return link_; }

 private:
  int workers_ = 2;
  std::int64_t cap_ = 0;
  std::string optimizer_name_ = "adam";
  double state_per_param_ = 2.0;
  double step_temporaries_ = 2.0;
  std::optional<AdamState> adam_ = AdamState{};
  std::optional<SGDState> sgd_;
  std::optional<runtime::AnyStore> store_;
  double store_speed_ = 4e9;
  std::optional<runtime::AnyStore> optimizer_store_;
  double optimizer_store_speed_ = 4e9;
  std::vector<std::string> schedules_;
  std::vector<int> micro_batches_;
  std::optional<bool> fused_;
  PlanFor prefer_ = PlanFor::time;
  std::optional<torch::Device> device_;
  int rounds_ = 2;
  std::optional<double> headroom_;  // unset: 0.05, or 0.1 with ranks(N)
  bool separate_devices_ = false;
  int replicas_ = 1;
  bool shard_state_ = false;
  bool shard_gradients_ = false;
  std::int64_t bucket_bytes_ = 25LL << 20;
  int ranks_ = 0;
  std::optional<LinkSpeed> link_;
};

}  // namespace stagewise
