#pragma once

// Options resolved once (STYLE.md 14): the one function that turns a pipe's PipeOptions (and a
// distributed pipe's placement rules) into what its stages run with, for every kind of pipe:
// stagewise::Pipe, PipeOver<T>, distributed::Pipe and the 2-D pipe. Each rule is a function of
// its own; an option either takes effect in every kind of pipe or is refused here, at
// construction, naming the fix. A new option is a setter in options.hpp and a rule here.

#include "stagewise/core/detail/stage_spec.hpp"
#include "stagewise/nn/convert_deferred_batch_norm.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/pipe/resolved_options.hpp"
#include "stagewise/plan/detail/plan_search.hpp"
#include "stagewise/plan/memory_plan.hpp"
#include "stagewise/plan/stage_costs.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// The kind of pipe options are resolved for.
struct PipeKind {
  std::string who = "stagewise::Pipe";  // opens every error
  int processes = 1;                     // the processes the pipe's stages run in
  int rank = 0;                          // this process's rank (names its store's files)
  int replicas = 1;                      // data-parallel replicas
  // A distributed pipe places its stages on ranks itself: by `placement` (stage count -> rank of
  // each stage) if given, else stage j on rank j % (stages / virtual_stages).
  bool places_ranks = false;
  int virtual_stages = 1;
  std::function<std::vector<int>(int)> placement = {};
};

// What a pipe is built from: its resolved options, its stages and, for a pipe over a
// Sequential, the layers they hold (with deferred_batch_norm(true), the DeferredBatchNorms).
struct ResolvedPipe {
  ResolvedPipeOptions options;
  std::vector<StageSpec> specs;
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
};

// One mode per stage, or one for all.
inline std::vector<Checkpoint> resolve_checkpoints(const PipeOptions& o, std::size_t stages) {
  return o.checkpoints(stages);
}

// Deferred batch norm keeps running statistics of a replica's own rows: replicas would drift.
inline void check_deferred_batch_norm(const PipeOptions& o, const PipeKind& kind) {
  TORCH_CHECK(!o.deferred_batch_norm() || kind.replicas == 1, kind.who,
              ": PipeOptions().deferred_batch_norm(true) with Options().data_parallel(",
              kind.replicas,
              "): each replica would keep running statistics of its own rows only, and the "
              "replicas' would drift apart; turn one of them off (plain batch norm, or one "
              "replica)");
}

// Every stage's rank within a replica (a distributed pipe), or nothing (one process: the
// schedule places the stages on workers): as Options::placed_like says, else as the options'
// schedule places them (PipeOptions().schedule(...), unless virtual_stages says otherwise), else
// stage j on rank j % (stages / virtual_stages).
inline std::vector<int> resolve_placement(const PipeOptions& o, const PipeKind& kind, int stages) {
  if (!kind.places_ranks) return {};
  if (kind.placement) return kind.placement(stages);
  if (o.schedule() && kind.virtual_stages == 1) {
    std::vector<int> out;
    for (int j = 0; j < stages; ++j) out.push_back(o.schedule()->worker_of(j, stages));
    return out;
  }
  const int v = kind.virtual_stages;
  TORCH_CHECK(v >= 1 && stages % v == 0, kind.who, ": ", stages, " stages do not split into ", v,
              " virtual stages per rank; give a balance with a multiple of ", v,
              " entries or change Options::virtual_stages");
  std::vector<int> out;
  for (int j = 0; j < stages; ++j) out.push_back(j % (stages / v));
  return out;
}

// The offload costs with `stages` spelled out per stage: as given, or every stage but the first
// (the caller's batch holds the first's inputs anyway).
inline schedule::OffloadCosts resolve_offload_costs(const PipeOptions& o, const PipeKind& kind,
                                                    std::size_t stages) {
  schedule::OffloadCosts costs = o.offload_costs();
  TORCH_CHECK(costs.stages.empty() || costs.stages.size() == stages, kind.who,
              ": offload's costs name ", costs.stages.size(), " stages for a pipe of ", stages,
              "; give OffloadCosts::stages one entry per stage, or leave it empty (every stage "
              "but the first)");
  if (costs.stages.empty()) {
    costs.stages.assign(stages, true);
    if (stages > 0) costs.stages[0] = false;
  }
  return costs;
}

// The store, named after this process where several share a machine (a FileStore's files).
// Copies of a store are one store, so naming the resolved copy names the user's too.
inline std::optional<runtime::AnyStore> resolve_store(std::optional<runtime::AnyStore> store,
                                                      const PipeKind& kind) {
  if (store && kind.processes > 1) store->set_owner("rank" + std::to_string(kind.rank));
  return store;
}

// Each stage's share of optimizer state off the device: one for all, or one per stage.
inline std::vector<double> resolve_optimizer_shares(const PipeOptions& o, const PipeKind& kind,
                                                    std::size_t stages) {
  if (!o.optimizer_store()) return {};
  const auto& shares = o.optimizer_shares();
  TORCH_CHECK(shares.size() == 1 || shares.size() == stages, kind.who,
              ": optimizer_offload gives ", shares.size(), " shares for a pipe of ", stages,
              " stages; give one share per stage, or one for all");
  return shares.size() == 1 ? std::vector<double>(stages, shares.front()) : shares;
}

// A store given for activations must keep them (a store of optimizer state only cannot).
inline void check_offload_store(const PipeOptions& o, const PipeKind& kind) {
  const auto& budget = o.memory_budget();
  for (const auto* store : {&o.offload_store(), budget ? &budget->store : nullptr}) {
    if (store == nullptr || !store->has_value()) continue;
    TORCH_CHECK((*store)->keeps_activations(), kind.who, ": ", (*store)->describe(),
                " keeps no activations (it is not a runtime::offload_store); give offload(...) "
                "and memory_budget(...) a HostStore or a FileStore");
  }
}

// The budget's refusals that do not need the model: a typed stage list (nothing to profile),
// checkpoint modes set by hand, two stores.
inline void check_memory_budget(const PipeOptions& o, const PipeKind& kind, bool sequential) {
  if (!o.memory_budget()) return;
  TORCH_CHECK(sequential, kind.who,
              ": memory_budget plans from the layers of a Sequential; build the pipe from a "
              "torch::nn::Sequential and a balance, or set checkpoint(...) and offload(...) "
              "yourself");
  TORCH_CHECK(!o.checkpoint_given(), kind.who,
              ": memory_budget chooses each stage's checkpoint mode, and checkpoint(...) sets "
              "them too; drop checkpoint(...) to let the budget choose, or drop the budget");
  TORCH_CHECK(!(o.memory_budget()->store && o.offload_store()), kind.who,
              ": memory_budget(bytes, sample, store) and offload(store) both give a store; give "
              "it once: to memory_budget, or to offload(store, costs) with "
              "memory_budget(bytes, sample)");
}

// A memory budget's plan for the stages of `seq` split by `b`: plan_pipeline's search
// (plan_search.hpp) held to the pipe's split, schedule and micro-batches, on the stages profiled
// alone (profile_stages), counting the activations each worker's cells keep and work with. The
// plan is applied to `r`: each stage's mode, and the store with the stages that offload.
inline void apply_memory_budget(const PipeOptions& o, const PipeKind& kind,
                                const torch::nn::Sequential& seq, const balance& b,
                                ResolvedPipeOptions& r) {
  const MemoryBudget& budget = *o.memory_budget();
  const auto costs = profile_stages(seq, b, budget.sample, BalanceOptions().rounds(1));
  SearchInput in;
  in.sched = &budget.schedule;
  in.stages = static_cast<int>(costs.size());
  in.micro_batches = static_cast<int>(r.chunks);
  in.costs = &costs;
  in.state.assign(costs.size(), schedule::StageState{});  // activations only
  in.step_seconds.assign(costs.size(), 0.0);
  in.may_offload = budget.store.has_value() || r.offload_store.has_value();
  in.cap = static_cast<double>(budget.bytes);
  in.separate_devices = kind.processes > 1;
  in.copies = r.offload_costs;
  schedule::PlanCache plans;
  const auto best = search_choices(in, /*for_memory=*/false, plans);
  TORCH_CHECK(best.peak <= in.cap, "stagewise::PipeOptions().memory_budget: no plan of ",
              budget.schedule.name(), " with ", r.chunks, " micro-batches fits ", budget.bytes,
              " bytes of activations per stage; the smallest budget that fits is ",
              static_cast<std::int64_t>(std::ceil(best.peak)),
              " bytes. Give at least that, or more micro-batches (smaller ones)",
              in.may_offload ? "" : ", or a store to offload to");
  schedule::MemoryPlan plan;
  plan.budget = budget.bytes;
  plan.schedule = budget.schedule.name();
  plan.micro_batches = in.micro_batches;
  for (const auto& c : best.choices) {
    plan.checkpoints.push_back(c.mode);
    plan.offload_stages.push_back(c.offload);
  }
  plan.offloaded = schedule::offloaded(best.plan);
  plan.offload = !plan.offloaded.empty();
  plan.predicted_peak = best.weight.peaks;
  plan.step_time = best.weight.time;
  r.checkpoints = plan.checkpoints;
  if (plan.offload) {
    if (budget.store) r.offload_store = budget.store;
    r.offload_costs.stages = plan.offload_stages;
  } else {
    r.offload_store.reset();
  }
  r.memory_plan = std::move(plan);
}

// Everything but the budget, for `stages` stages.
inline ResolvedPipeOptions resolve_common(const PipeOptions& o, const PipeKind& kind,
                                          std::size_t stages, bool sequential) {
  check_deferred_batch_norm(o, kind);
  check_memory_budget(o, kind, sequential);
  check_offload_store(o, kind);
  ResolvedPipeOptions r;
  r.chunks = o.chunks();
  r.checkpoints = resolve_checkpoints(o, stages);
  r.devices = o.devices();
  r.deferred_batch_norm = o.deferred_batch_norm();
  r.offload_store = o.offload_store();
  r.offload_costs = resolve_offload_costs(o, kind, stages);
  r.placement = resolve_placement(o, kind, static_cast<int>(stages));
  if (o.schedule()) r.schedule = *o.schedule();
  r.optimizer_shares = resolve_optimizer_shares(o, kind, stages);
  r.optimizer_store = resolve_store(o.optimizer_store(), kind);
  return r;
}

/// The pipe over `seq` split by `b`: with deferred_batch_norm(true), its stages come from a copy
/// whose batch norms are DeferredBatchNorms sharing their tensors; a memory budget plans on
/// copies of its layers.
inline ResolvedPipe resolve_pipe(const PipeOptions& o, const PipeKind& kind,
                                 const torch::nn::Sequential& seq, const balance& b) {
  ResolvedPipe out;
  const auto stages = o.deferred_batch_norm() ? convert_deferred_batch_norm(seq, o.chunks()) : seq;
  out.layers = stages->children();
  out.specs = partition(stages, b);
  out.options = resolve_common(o, kind, out.specs.size(), /*sequential=*/true);
  if (o.memory_budget()) apply_memory_budget(o, kind, seq, b, out.options);
  out.options.offload_store = resolve_store(std::move(out.options.offload_store), kind);
  return out;
}

/// The pipe over typed stages (a memory budget is refused: there are no layers to profile).
inline ResolvedPipe resolve_pipe(const PipeOptions& o, const PipeKind& kind,
                                 std::vector<StageSpec> specs) {
  ResolvedPipe out;
  out.options = resolve_common(o, kind, specs.size(), /*sequential=*/false);
  out.options.offload_store = resolve_store(std::move(out.options.offload_store), kind);
  out.specs = std::move(specs);
  return out;
}

}  // namespace stagewise::detail
