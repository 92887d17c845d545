#pragma once

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/detail/state_offload_plan.hpp"
#include "stagewise/plan/link_speed.hpp"
#include "stagewise/plan/worker_memory.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/offload.hpp"
#include "stagewise/stage/partition.hpp"

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise {

class PipeOptions;
struct PipelinePlan;

/// One factorisation of `PlanOptions().ranks(N)` weighed: `stage_ranks` ranks per replica's
/// pipeline times `replicas`, with its sharding ("none", "optimizer state" for ZeRO-1,
/// "optimizer state and gradients" for ZeRO-2); its best candidate's predicted step and peak,
/// whether that fits, and if not (or if it was not weighed), why.
struct PlanFactorisation {
  int stage_ranks = 1;
  int replicas = 1;
  std::string sharding = "none";
  double step_seconds = 0;
  double peak = 0;
  bool fits = false;
  std::string why_not;
  std::string best;  ///< its best candidate, described
};

/// One configuration `plan_pipeline` weighed: what it is, its predicted step time and worst
/// worker's peak, whether it fits the cap (if not, why), and the configuration itself as a plan
/// (build it with `sw::Pipe(model, *candidate.plan)`, e.g. to measure it; null for a schedule
/// that could not be weighed).
struct PlanCandidate {
  std::string description;
  double step_seconds = 0;
  double peak = 0;  ///< the worst worker's predicted peak, bytes
  bool fits = false;
  std::string why_not;
  std::shared_ptr<const PipelinePlan> plan;
};

/// What `plan_pipeline` chose: the split, the schedule, the number of micro-batches, each
/// stage's checkpoint mode and whether it offloads, and whether the optimizer step is fused into
/// backward; with the predicted step time and each worker's predicted peak by what holds it.
/// `sw::Pipe(model, plan)` builds exactly that pipe, whose `train_step` runs the planned schedule;
/// `report()` says what was weighed and why.
///   auto plan = sw::plan_pipeline(model, batch, sw::PlanOptions().workers(4).memory_per_worker(cap));
///   std::cout << plan.report();
///   auto pipe = sw::Pipe(model, plan);
struct PipelinePlan {
  balance split;                 ///< layers per stage
  std::string split_by;          ///< "time" or "size" (the exact min-max split of either)
  schedule::any_schedule schedule{"gpipe", schedule::gpipe{}};
  int stages_per_worker = 1;     ///< 2 for the V-shaped and interleaved{2} schedules
  int workers = 1;
  std::int64_t micro_batches = 1;
  std::int64_t batch_rows = 0;
  std::vector<Checkpoint> checkpoints;  ///< per stage
  std::vector<bool> offload_stages;     ///< per stage
  std::optional<runtime::AnyStore> store;
  schedule::OffloadCosts offload_costs;
  /// Whether the plan counts on the optimizer step fused into backward (`optim::FusedStep`,
  /// passed to `train_step`): it frees each gradient once stepped.
  bool fused_step = false;
  std::string optimizer;               ///< what the state bytes were counted for
  /// Data-parallel replicas the memory was counted for (`PlanOptions::replicas`), and whether
  /// their optimizer state (and gradients) are sharded: build the 2-D pipe with
  /// `distributed::Options().data_parallel(replicas)` and the same sharding.
  int replicas = 1;
  bool shard_optimizer_state = false;
  bool shard_gradients = false;
  /// Per stage, the share of its optimizer state off the device (empty: none), in
  /// `optimizer_store` (`PipeOptions().optimizer_offload`).
  std::vector<double> optimizer_shares;
  std::optional<runtime::AnyStore> optimizer_store;
  /// The job's ranks the plan is for (`PlanOptions().ranks`: `workers` x `replicas`; 0: planned
  /// for `workers` of one process or replica), and the link its gradient exchange was costed on.
  /// `distributed::Pipe(model, plan)` builds it on a job of exactly `ranks` ranks.
  int ranks = 0;
  std::optional<LinkSpeed> link;
  /// With `ranks`: every factorisation weighed, fastest first (smallest first for memory).
  std::vector<PlanFactorisation> factorisations;
  std::int64_t cap = 0;                ///< bytes per worker
  double step_seconds = 0;             ///< predicted
  std::vector<schedule::WorkerMemory> memory;  ///< per worker, predicted
  /// Every candidate weighed, fastest first (or smallest first when planned for memory).
  std::vector<PlanCandidate> candidates;

  /// The options that build this pipe: chunks, checkpoint modes, offload and the schedule
  /// `train_step` runs (add `devices(...)` to place the stages). Defined with `PipeOptions` in
  /// pipe/options.hpp (the pipe layer, above this one).
  PipeOptions options() const;

  /// The worst worker's predicted peak, bytes.
  double peak() const {
    double most = 0;
    for (const auto& w : memory) most = std::max(most, w.peak);
    return most;
  }

  /// What was chosen, each worker's predicted peak by what holds it, and the candidates in order
  /// (the first 30) with their times and peaks, and why each one before the chosen was rejected.
  std::string report() const {
    constexpr std::size_t kShown = 30;
    std::ostringstream out;
    auto mib = [](double b) {
      std::ostringstream s;
      s << std::fixed << std::setprecision(2) << b / (1 << 20) << " MiB";
      return s.str();
    };
    if (ranks > 0) {
      out << "ranks plan: " << ranks << " ranks as " << workers << " x " << replicas << " ("
          << workers << (workers == 1 ? " rank" : " ranks") << " per pipeline, " << replicas
          << (replicas == 1 ? " replica" : " replicas") << ", sharding: "
          << sharding_name(shard_optimizer_state, shard_gradients) << "), link "
          << (link ? link->to_string() : std::string("not needed")) << "\n";
    }
    out << "pipeline plan: " << schedule.name() << " on " << workers << " workers ("
        << split.size() << " stages, split by " << split_by << ": ";
    for (std::size_t j = 0; j < split.size(); ++j) out << (j ? " " : "") << split[j];
    const auto rows = batch_rows / std::max<std::int64_t>(micro_batches, 1);
    out << " layers), " << micro_batches << " micro-batches of " << rows
        << (rows == 1 ? " row, " : " rows, ") << (fused_step ? "fused" : "unfused") << " "
        << optimizer << " step";
    if (replicas > 1) {
      out << " for each of " << replicas << " data-parallel replicas"
          << (shard_gradients         ? " (optimizer state and gradients sharded)"
              : shard_optimizer_state ? " (optimizer state sharded)"
                                      : "");
    }
    out << "; predicted step " << std::setprecision(4) << step_seconds * 1e3 << " ms, peak "
        << mib(peak()) << " of a cap of " << mib(static_cast<double>(cap)) << " per worker\n";
    for (std::size_t j = 0; j < checkpoints.size(); ++j) {
      out << "  stage " << j << ": checkpoint " << to_string(checkpoints[j])
          << (j < offload_stages.size() && offload_stages[j] ? ", offloads" : "");
      if (j < optimizer_shares.size() && optimizer_shares[j] > 0) {
        out << ", optimizer state " << detail::share_name(optimizer_shares[j])
            << " off the device";
      }
      out << "\n";
    }
    for (std::size_t w = 0; w < memory.size(); ++w) {
      const auto& m = memory[w];
      out << "  worker " << w << ": peak " << mib(m.peak) << " (expected " << mib(m.expected)
          << ") = parameters " << mib(m.params) << " + gradients " << mib(m.grads)
          << " + optimizer state " << mib(m.optimizer) << " + kept activations "
          << mib(m.activations) << " + working " << mib(m.working) << "; offloaded "
          << mib(m.offloaded);
      if (m.optimizer_offloaded > 0) {
        out << "; optimizer state off the device " << mib(m.optimizer_offloaded) << ", moved "
            << mib(m.moved) << " per step";
      }
      out << "\n";
    }
    if (!factorisations.empty()) out << factorisations_report();
    out << "candidates (" << candidates.size() << ", the first "
        << std::min<std::size_t>(candidates.size(), kShown) << " shown):\n";
    for (std::size_t k = 0; k < candidates.size() && k < kShown; ++k) {
      const auto& c = candidates[k];
      out << "  " << (c.fits ? "fits " : "over ") << std::setprecision(4)
          << c.step_seconds * 1e3 << " ms, peak " << mib(c.peak) << ": " << c.description;
      if (!c.fits) out << " - " << c.why_not;
      out << "\n";
    }
    return out.str();
  }

  /// "none", "optimizer state" (ZeRO-1) or "optimizer state and gradients" (ZeRO-2).
  static std::string sharding_name(bool state, bool grads) {
    return grads ? "optimizer state and gradients" : state ? "optimizer state" : "none";
  }

 private:
  // The factorisations weighed, in order, each faster one than the chosen with why it was not.
  std::string factorisations_report() const {
    std::ostringstream out;
    out << "factorisations (" << factorisations.size() << "):\n";
    bool before = true;
    for (const auto& f : factorisations) {
      const bool chosen = f.stage_ranks == workers && f.replicas == replicas &&
                          f.sharding == sharding_name(shard_optimizer_state, shard_gradients);
      out << "  " << (chosen ? "chosen " : f.fits ? "fits   " : "over   ") << f.stage_ranks << " x "
          << f.replicas << ", sharding " << f.sharding;
      if (f.best.empty()) {
        out << " - " << f.why_not << "\n";
        continue;
      }
      out << ": step " << std::setprecision(4) << f.step_seconds * 1e3 << " ms, peak "
          << std::fixed << std::setprecision(2) << f.peak / (1 << 20) << " MiB"
          << std::defaultfloat;
      out << " (" << f.best << ")";
      if (before && !chosen) out << " - rejected: " << f.why_not;
      out << "\n";
      if (chosen) before = false;
    }
    return out.str();
  }
};

}  // namespace stagewise
