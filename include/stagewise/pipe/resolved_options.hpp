#pragma once

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/memory_plan.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/offload.hpp"

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace stagewise {

/// What a pipe runs with: its `PipeOptions` with every default decided, every dependent choice
/// made (a memory budget's checkpoint modes and offloads, which stages offload, the store's
/// per-process name) and every combination the kind of pipe cannot run refused. Every pipe
/// (`Pipe`, `PipeOver<T>`, `distributed::Pipe` with or without replicas) builds it once, at
/// construction, in one function, and reads nothing else of the options after; the user's
/// `PipeOptions` are left as they were given.
///   auto r = pipe->resolved_options();
///   r.checkpoints[1];      // stage 1's mode, chosen by a memory budget or set by checkpoint(...)
///   r.memory_plan->to_string();
struct ResolvedPipeOptions {
  /// Micro-batches per mini-batch.
  std::int64_t chunks = 1;
  /// Each stage's checkpoint mode, one per stage.
  std::vector<Checkpoint> checkpoints;
  /// Each stage's device, one per stage; empty: each stage stays where its module is.
  std::vector<torch::Device> devices;
  /// Whether batch norms of a Sequential became `DeferredBatchNorm`s.
  bool deferred_batch_norm = false;
  /// Where checkpointed cells offload (none: no offload), and the offload pass's costs, whose
  /// `stages` says, one entry per stage, which stages may offload.
  std::optional<runtime::AnyStore> offload_store;
  schedule::OffloadCosts offload_costs;
  /// What `memory_budget` chose (none without a budget).
  std::optional<schedule::MemoryPlan> memory_plan;
  /// A distributed pipe's rank (within a replica) of every stage; empty in one process, where
  /// each step's schedule places the stages on workers.
  std::vector<int> placement;
  /// Where each stage's optimizer state lives (`optimizer_offload`; none: on the device), and the
  /// share of its parameters' bytes there, one per stage.
  std::optional<runtime::AnyStore> optimizer_store;
  std::vector<double> optimizer_shares;
  /// The schedule `train_step` runs when given none.
  ::stagewise::schedule::any_schedule schedule{"gpipe", ::stagewise::schedule::gpipe{}};
};

}  // namespace stagewise
