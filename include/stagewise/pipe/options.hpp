#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace stagewise {

/// What `PipeOptions().memory_budget(...)` was given: the budget in bytes of activations per
/// stage, one micro-batch like those the pipe will run (to profile), the store offloads may use
/// (none: the one `offload(...)` gave, if any) and the schedule the plan is for. The offload
/// costs are `PipeOptions().offload(store, costs)`'s, read when the pipe is built, whatever the
/// order of the setters.
struct MemoryBudget {
  std::int64_t bytes = 0;
  Batch sample{torch::Tensor()};
  std::optional<runtime::AnyStore> store;
  schedule::any_schedule schedule{"one_f_one_b", schedule::one_f_one_b{}};
};

/// Options of a Pipe, as chained setters in LibTorch's style. They hold what was set, nothing
/// more: every pipe turns them into the values its stages run with in one place
/// (`ResolvedPipeOptions`, `pipe->resolved_options()`), where defaults are decided and options
/// that cannot work together, or not in that kind of pipe, are refused at construction. No
/// setter's effect depends on the order of the calls, and a pipe never writes into them.
///   stagewise::PipeOptions().chunks(8).checkpoint(stagewise::Checkpoint::except_last)
class PipeOptions {
 public:
  /// Number of micro-batches a mini-batch is split into (> 0; default 1).
  PipeOptions& chunks(int64_t n) {
    TORCH_CHECK(n > 0, "stagewise::PipeOptions: chunks must be positive, got ", n,
                "; use chunks(1) to run the mini-batch whole");
    chunks_ = n;
    return *this;
  }
  /// Checkpointing mode of every stage (default except_last).
  PipeOptions& checkpoint(Checkpoint mode) {
    (void)to_string(mode);  // rejects values outside the enum
    checkpoint_ = mode;
    stage_checkpoints_.clear();
    return *this;
  }
  /// One checkpointing mode per stage, in stage order: e.g. 1F1B's last stage runs each
  /// micro-batch's backward right after its forward, so checkpointing it saves nothing and costs
  /// a recompute. The pipe refuses a list whose length is not its number of stages.
  ///   sw::PipeOptions().chunks(8).checkpoint({sw::Checkpoint::except_last,
  ///                                           sw::Checkpoint::never})
  PipeOptions& checkpoint(std::vector<Checkpoint> per_stage) {
    TORCH_CHECK(!per_stage.empty(),
                "stagewise::PipeOptions: checkpoint got an empty list of modes; give one mode "
                "per stage, or one mode for all (checkpoint(Checkpoint::except_last))");
    for (auto mode : per_stage) (void)to_string(mode);
    stage_checkpoints_ = std::move(per_stage);
    checkpoint_.reset();
    return *this;
  }
  /// Checkpointing mode by name: "always", "except_last" or "never".
  PipeOptions& checkpoint(std::string_view mode) { return checkpoint(checkpoint_mode(mode)); }
  /// One device per stage, in order (devices may repeat; default: every stage on the CPU).
  PipeOptions& devices(std::vector<torch::Device> devices) {
    devices_ = std::move(devices);
    return *this;
  }

  /// Deferred batch norm (default off): when the Pipe is built from a Sequential, every
  /// BatchNorm1d/2d/3d with running statistics becomes a `DeferredBatchNorm` sharing its
  /// parameters and buffers, whose running mean and variance are updated once per mini-batch, as
  /// plain batch norm over the whole mini-batch would (see docs/pipe.md).
  ///   stagewise::PipeOptions().chunks(4).deferred_batch_norm(true)
  PipeOptions& deferred_batch_norm(bool on) {
    deferred_batch_norm_ = on;
    return *this;
  }

  /// Activation offload (default off): in `train_step`, what each checkpointed cell keeps (its
  /// inputs and the skips it popped) goes to `store` after its forward and comes back before its
  /// recompute, as offload O and reload L actions that `schedule::offload` places in the plan
  /// from `costs`: only where the forward-to-backward gap hides `costs.round_trips` copies. With
  /// `costs.stages` empty every stage but the first offloads (the caller's batch holds the
  /// first's inputs anyway). Results are bit-identical to the same pipe without offload. Only
  /// checkpointed cells offload: pair it with Checkpoint::always (or except_last). See
  /// docs/memory.md.
  ///   stagewise::PipeOptions().chunks(8).checkpoint("always")
  ///       .offload(stagewise::runtime::FileStore("/nvme/offload"))
  PipeOptions& offload(runtime::AnyStore store, ::stagewise::schedule::OffloadCosts costs = {}) {
    TORCH_CHECK(costs.round_trips >= 0.0, "stagewise::PipeOptions: offload's round_trips is ",
                costs.round_trips, "; give 0 or more (3: a pair must hide three copies)");
    offload_store_ = std::move(store);
    offload_costs_ = std::move(costs);
    return *this;
  }

  /// Optimizer state off the device (default none): of each stage's parameters, `share` (0 to 1)
  /// of their bytes, whole tensors, largest first, keep their optimizer state in `store` (a
  /// `HostStore` or a `FileStore`; it may also be the activations' `offload` store) and take
  /// their step on the host (`runtime::OffloadedState`, bit-identical on the CPU). The pipe gives
  /// it to the fused step passed to `train_step` (one that has no offload of its own); an unfused
  /// optimizer takes it from `pipe->offloaded_state()` (`optim::OffloadedOptimizer`). A
  /// distributed pipe's ranks each keep their stages' (a `FileStore`'s files named after the
  /// rank). See docs/memory.md, "The model's state".
  ///   sw::PipeOptions().chunks(8).optimizer_offload(sw::runtime::HostStore(), 0.5)
  PipeOptions& optimizer_offload(runtime::AnyStore store, double share = 1.0) {
    return optimizer_offload(std::move(store), std::vector<double>{share});
  }
  /// Optimizer state off the device, one share per stage, in stage order (the pipe refuses a
  /// list whose length is not its number of stages).
  ///   sw::PipeOptions().optimizer_offload(sw::runtime::FileStore("/nvme/state"), {0.0, 0.5, 1.0})
  PipeOptions& optimizer_offload(runtime::AnyStore store, std::vector<double> shares) {
    TORCH_CHECK(!shares.empty(), "stagewise::PipeOptions: optimizer_offload got no share; give "
                "one share for every stage, or one per stage");
    for (double s : shares) {
      TORCH_CHECK(s >= 0.0 && s <= 1.0, "stagewise::PipeOptions: optimizer_offload's share is ", s,
                  "; give a share of a stage's parameter bytes from 0 (none) to 1 (all)");
    }
    TORCH_CHECK(store.keeps_state(), "stagewise::PipeOptions: optimizer_offload: ",
                store.describe(),
                " keeps no optimizer state (it is not a runtime::state_store); give a HostStore "
                "or a FileStore");
    optimizer_store_ = std::move(store);
    optimizer_shares_ = std::move(shares);
    return *this;
  }

  /// A memory budget (default none): a pipe built from a Sequential profiles each stage alone on
  /// `sample` (one micro-batch; `profile_stages`) and picks, with `plan_pipeline`'s search held
  /// to the pipe's split, micro-batches and `sched`, each stage's checkpoint mode and offload
  /// choice (to `store`, or to the store `offload(...)` gave, with its costs), the fastest plan
  /// whose predicted activation peak (what each worker's cells keep and work with) is at most
  /// `bytes` on every worker; the pipe runs those modes and offloads (`pipe->resolved_options()`), and
  /// `pipe->memory_plan()` prints what it chose. When nothing fits, construction fails naming
  /// the smallest budget that would. The budget chooses the checkpoint modes, so it is refused
  /// with `checkpoint(...)`; a store given both here and to `offload(...)` is refused too. Every
  /// kind of pipe built from a Sequential plans it (a distributed pipe's ranks each make the
  /// same plan); a pipe of typed stages refuses it. The budget counts activations, not
  /// parameters, gradients or optimizer state.
  ///   sw::PipeOptions().chunks(8).memory_budget(64 << 20, torch::randn({64, 1024}),
  ///                                            sw::runtime::FileStore("/nvme/offload"))
  PipeOptions& memory_budget(std::int64_t bytes, Batch sample,
                             std::optional<runtime::AnyStore> store = std::nullopt,
                             ::stagewise::schedule::any_schedule sched = {"one_f_one_b",
                                                             ::stagewise::schedule::one_f_one_b{}}) {
    TORCH_CHECK(bytes > 0, "stagewise::PipeOptions: memory_budget is ", bytes,
                " bytes; give a positive number of bytes of activations per stage");
    memory_budget_ = MemoryBudget{bytes, std::move(sample), std::move(store), std::move(sched)};
    return *this;
  }

  /// The schedule `train_step` runs when it is given none (default: GPipe's fill-drain), e.g.
  /// the one `plan_pipeline` chose. A distributed pipe places its stages on ranks as the schedule
  /// places them on workers, unless its Options say otherwise.
  ///   sw::PipeOptions().chunks(8).schedule({"one_f_one_b", sw::schedule::one_f_one_b{}})
  PipeOptions& schedule(::stagewise::schedule::any_schedule s) {
    schedule_ = std::move(s);
    return *this;
  }
  const std::optional<::stagewise::schedule::any_schedule>& schedule() const { return schedule_; }

  int64_t chunks() const { return chunks_; }
  const std::optional<MemoryBudget>& memory_budget() const { return memory_budget_; }
  const std::optional<runtime::AnyStore>& offload_store() const { return offload_store_; }
  /// Where `optimizer_offload` keeps optimizer state (none: on the device), and its shares (one
  /// for every stage, or one per stage).
  const std::optional<runtime::AnyStore>& optimizer_store() const { return optimizer_store_; }
  const std::vector<double>& optimizer_shares() const { return optimizer_shares_; }
  const ::stagewise::schedule::OffloadCosts& offload_costs() const { return offload_costs_; }
  /// The mode of every stage; an error when the modes differ per stage (read checkpoint_of).
  Checkpoint checkpoint() const {
    for (auto mode : stage_checkpoints_) {
      TORCH_CHECK(mode == stage_checkpoints_.front(),
                  "stagewise::PipeOptions::checkpoint(): the stages have different modes; read "
                  "each with checkpoint_of(stage)");
    }
    return stage_checkpoints_.empty() ? checkpoint_.value_or(Checkpoint::except_last)
                                      : stage_checkpoints_.front();
  }
  /// Whether `checkpoint(...)` was called (otherwise every stage runs except_last, or what a
  /// memory budget chooses).
  bool checkpoint_given() const { return checkpoint_.has_value() || !stage_checkpoints_.empty(); }
  /// The mode of stage `stage`.
  Checkpoint checkpoint_of(std::size_t stage) const {
    if (stage_checkpoints_.empty()) return checkpoint_.value_or(Checkpoint::except_last);
    TORCH_CHECK_INDEX(stage < stage_checkpoints_.size(), "stagewise::PipeOptions: checkpoint ",
                      "gives modes for ", stage_checkpoints_.size(), " stages, not stage ", stage);
    return stage_checkpoints_[stage];
  }
  /// Each of `stages` stages' mode, in order; refuses a per-stage list of another length.
  std::vector<Checkpoint> checkpoints(std::size_t stages) const {
    TORCH_CHECK(stage_checkpoints_.empty() || stage_checkpoints_.size() == stages,
                "stagewise::PipeOptions: checkpoint gives ", stage_checkpoints_.size(),
                " modes for a pipe of ", stages,
                " stages; give one mode per stage, or one mode for all");
    return stage_checkpoints_.empty()
               ? std::vector<Checkpoint>(stages, checkpoint_.value_or(Checkpoint::except_last))
               : stage_checkpoints_;
  }
  const std::vector<torch::Device>& devices() const { return devices_; }
  bool deferred_batch_norm() const { return deferred_batch_norm_; }

 private:
  int64_t chunks_ = 1;
  std::optional<Checkpoint> checkpoint_;       // none: except_last (or the budget's choice)
  std::vector<Checkpoint> stage_checkpoints_;  // empty: checkpoint_ on every stage
  std::vector<torch::Device> devices_;
  bool deferred_batch_norm_ = false;
  std::optional<runtime::AnyStore> offload_store_;
  ::stagewise::schedule::OffloadCosts offload_costs_;
  std::optional<MemoryBudget> memory_budget_;
  std::optional<::stagewise::schedule::any_schedule> schedule_;
  std::optional<runtime::AnyStore> optimizer_store_;
  std::vector<double> optimizer_shares_;
};

/// The options that build the pipe `plan` describes (`PipelinePlan::options`, declared with the
/// plan in plan/pipeline_plan.hpp, a layer below `PipeOptions`).
inline PipeOptions PipelinePlan::options() const {
  auto o = PipeOptions().chunks(micro_batches).checkpoint(checkpoints).schedule(schedule);
  if (store && std::find(offload_stages.begin(), offload_stages.end(), true) !=
                   offload_stages.end()) {
    schedule::OffloadCosts costs = offload_costs;
    costs.stages = offload_stages;
    o.offload(*store, costs);
  }
  if (optimizer_store && std::any_of(optimizer_shares.begin(), optimizer_shares.end(),
                                     [](double s) { return s > 0; })) {
    o.optimizer_offload(*optimizer_store, optimizer_shares);
  }
  return o;
}

}  // namespace stagewise
