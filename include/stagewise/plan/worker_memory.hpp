#pragma once

#include "stagewise/plan/detail/shared_bytes.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace stagewise::schedule {

/// What a stage holds besides its cells' activations, for `worker_memory`: its parameters, their
/// gradients, the optimizer's state for them, and an optimizer step's temporaries (about its
/// largest parameter's bytes for Adam, which steps one parameter at a time).
///   stagewise::schedule::StageState{.params = 4e6, .grads = 4e6, .optimizer = 8e6,
///                                   .step_working = 1e6}
struct StageState {
  double params = 0;
  double grads = 0;
  double optimizer = 0;  ///< the optimizer's state on the device
  double step_working = 0;
  /// The optimizer's state kept off the device (`PipeOptions().optimizer_offload`: a host or
  /// file store; not on the device), and the bytes that offload moves per step (gradients and
  /// values to the host and back, the state out of the store and into it).
  double optimizer_offloaded = 0;
  double moved = 0;
};

/// How data-parallel replicas of a pipeline hold each stage (the 2-D pipe,
/// `distributed::Options().data_parallel(d)`), for `replica_state`: d replicas, each stage's
/// optimizer state sharded over them (ZeRO-1, `shard_optimizer_state`), and its gradients too
/// (ZeRO-2, `shard_gradients`); the reducer's bucket size; the stage's largest parameter.
///   stagewise::schedule::StageReplicas{.replicas = 2, .shard_gradients = true,
///                                      .largest_tensor = 1 << 20}
struct StageReplicas {
  int replicas = 1;
  bool shard_optimizer_state = false;
  bool shard_gradients = false;  ///< implies shard_optimizer_state
  double bucket_bytes = 25.0 * (1 << 20);
  double largest_tensor = 0;
  /// The share of the stage's parameter bytes its most loaded replica owns, when known (from
  /// `optim::shard_owners` over its tensors); 0: bounded by 1/d plus the largest tensor.
  double owned_share = 0;
};

/// A worker's bytes at its peak, by what holds them; `peak` is their sum: what the worker's
/// device must hold, whatever the workers' relative speeds. `offloaded` is the most bytes its
/// cells had in the store at once (host memory or files, not counted in `peak`). `expected` is
/// the peak where the workers keep to a simulated clock, `least` where every other worker is as
/// quick as it may be (`least` <= `expected` <= `peak`; they differ only by tensors one worker
/// makes and another lets go: see `worker_memory`).
struct WorkerMemory {
  double params = 0;
  double grads = 0;
  double optimizer = 0;
  double activations = 0;  ///< what the cells keep: whole, or a checkpointed cell's inputs
  double working = 0;      ///< the running action's working memory, or the step's temporaries
  double peak = 0;
  double offloaded = 0;
  double expected = 0;
  double least = 0;
  /// Its stages' optimizer state off the device (not counted in `peak`), and the bytes that
  /// offload moves per step (`StageState::optimizer_offloaded`, `moved`).
  double optimizer_offloaded = 0;
  double moved = 0;
};

/// What one of `r.replicas` replicas holds of a stage whose whole state is `whole`, for
/// `worker_memory` (with d > 1, pass it `fused` false: a 2-D pipe's fused step runs after the
/// reduction, at the end of the step, as an unfused step does):
/// - unsharded: the gradients and the reducer's bucket copies of them (kept between steps);
/// - sharded optimizer state: its shard of the state, at most whole / d plus the largest tensor
///   (parameters are owned whole, balanced by size), and the step temporaries of its shard; the
///   gradients whole until the reduction, whose copies replace them bucket by bucket (a bucket's
///   flat copy and its owned part's copy of the sum on top, as the bucket leaves);
/// - sharded gradients too: its shard of the gradients, plus two buckets in flight and the
///   gradient being computed (at most what the sharded optimizer state alone holds).
///   auto mine = stagewise::schedule::replica_state({.params = 8e6, .grads = 8e6,
///                                                   .optimizer = 16e6, .step_working = 2e6},
///                                                  {.replicas = 2, .shard_gradients = true});
inline StageState replica_state(const StageState& whole, const StageReplicas& r) {
  TORCH_CHECK(r.replicas >= 1, "stagewise::schedule::replica_state: ", r.replicas,
              " replicas; give 1 or more");
  if (r.replicas == 1) return whole;
  StageState out = whole;
  if (!r.shard_optimizer_state && !r.shard_gradients) {
    out.grads = 2 * whole.grads;  // the gradients and their bucket copies
    return out;
  }
  const double d = r.replicas;
  // The most one owner can hold of `x` (greedy by size: at most x / d plus the largest tensor).
  const double whole_bytes = std::max(whole.params, 1.0);
  const double owned = r.owned_share > 0 ? std::min(1.0, r.owned_share)
                                         : std::min(1.0, 1.0 / d + r.largest_tensor / whole_bytes);
  out.optimizer = whole.optimizer * owned;
  // A bucket's flat copy while it travels, and its owned part's copy as the sum arrives.
  const double bucket = std::min(r.bucket_bytes, whole.grads);
  out.grads = whole.grads + bucket * (1 + owned);
  if (r.shard_gradients) {
    const double in_flight = 2 * r.bucket_bytes + r.largest_tensor;
    out.grads = std::min(out.grads, whole.grads * owned + in_flight);
  }
  return out;
}

namespace detail {

// Each stage's first and last action that accumulates its weights' gradients (B or W), as
// indices into its worker's program.
struct GradientSpan {
  int first = -1;
  int last = -1;
};

inline std::vector<GradientSpan> gradient_spans(const Plan& plan) {
  std::vector<GradientSpan> spans(static_cast<std::size_t>(plan.stages));
  for (const auto& program : plan.programs) {
    for (std::size_t k = 0; k < program.size(); ++k) {
      const Action& a = program[k];
      if (a.kind != ActionKind::backward && a.kind != ActionKind::weight_grad) continue;
      auto& s = spans[static_cast<std::size_t>(a.stage)];
      if (s.first < 0) s.first = static_cast<int>(k);
      s.last = static_cast<int>(k);
    }
  }
  return spans;
}

// The running total of one worker, and its largest value with what made it.
struct WorkerTally {
  WorkerMemory now;
  WorkerMemory at_peak;
  void see(double working) {
    const double total = now.params + now.grads + now.optimizer + now.activations + working;
    if (total > at_peak.peak) {
      at_peak = now;
      at_peak.working = working;
      at_peak.peak = total;
    }
  }
};

}  // namespace detail

namespace detail {

// The walk of one worker's program for worker_memory: its running totals, action by action.
class MemoryWalk {
 public:
  MemoryWalk(const Plan& plan, const std::vector<CellBytes>& cells,
             const std::vector<StageState>& state, bool fused, const Timeline* timeline)
      : plan_(plan),
        cells_(cells),
        state_(state),
        fused_(fused),
        spans_(gradient_spans(plan)),
        shared_(shared_bytes(plan, cells, timeline)) {
    for (const auto& b : cells) one_process_ = one_process_ || b.output > 0;
    const auto n =
        static_cast<std::size_t>(plan.stages) * static_cast<std::size_t>(plan.micro_batches);
    recomputed_.assign(n, 0);
    for (const auto& program : plan.programs) {
      for (const auto& a : program) {
        if (a.kind == ActionKind::recompute) recomputed_[cell(a)] = 1;
      }
    }
  }

  // Worker w's peak, by what holds it, and its expected peak.
  WorkerMemory worker(int w) {
    WorkerMemory out = walk(w, shared_.before);
    out.least = walk(w, shared_.soonest).peak;
    out.expected = shared_.expected.empty() ? out.peak : walk(w, shared_.expected).peak;
    out.expected = std::max(out.expected, out.least);
    return out;
  }

  // Worker w's program, with the shared tensors freed before each action as `freed` says.
  WorkerMemory walk(int w, const std::vector<std::vector<double>>& freed_before) {
    WorkerTally t;
    double step_working = 0;  // the largest of the worker's stages' (the unfused step's)
    for (int s : plan_.stages_of(w)) {
      t.now.params += state_of(s).params;
      t.now.optimizer += state_of(s).optimizer;
      step_working = std::max(step_working, state_of(s).step_working);
    }
    offloaded_ = most_offloaded_ = 0;
    own_.assign(recomputed_.size(), 0.0);
    reloaded_.assign(recomputed_.size(), 0);
    t.see(0);
    const auto& program = plan_.programs[static_cast<std::size_t>(w)];
    const auto& shared = shared_.after[static_cast<std::size_t>(w)];
    const auto& freed = freed_before[static_cast<std::size_t>(w)];
    for (std::size_t k = 0; k < program.size(); ++k) {
      t.now.activations -= freed[k];
      act(program[k], static_cast<int>(k), shared[k], t);
      t.see(0);
    }
    t.now.activations -= freed[program.size()];
    if (!fused_) t.see(step_working);  // the optimizer's step, after the pipeline's
    WorkerMemory out = t.at_peak;
    out.offloaded = most_offloaded_;
    for (int s : plan_.stages_of(w)) {
      out.optimizer_offloaded += state_of(s).optimizer_offloaded;
      out.moved += state_of(s).moved;
    }
    return out;
  }

 private:
  // Action `a`, the k-th of its worker's program: its working memory counts while it runs, then
  // what its cell holds changes (`own_`: the cell's own bytes), and it makes `made` bytes it
  // shares with another stage's cell (`shared_`).
  void act(const Action& a, int k, double made, WorkerTally& t) {
    const auto& b = bytes_of(a.stage);
    const auto& st = state_of(a.stage);
    const auto& span = spans_[static_cast<std::size_t>(a.stage)];
    const double kept = b.kept < 0.0 ? b.forward : b.kept;
    const bool weights = a.kind == ActionKind::backward || a.kind == ActionKind::weight_grad;
    const bool last = fused_ && k == span.last;  // the fused step steps the stage here
    // With the fused step, a stage whose only gradient action is its last never holds all its
    // gradients: each is stepped and freed as soon as it is final.
    const bool whole_grads = !(fused_ && span.first == span.last);
    if (weights && k == span.first && whole_grads) t.now.grads += st.grads;
    const double step = last ? st.step_working : 0.0;
    switch (a.kind) {
      case ActionKind::backward:
        t.see(b.working + step);
        break;
      case ActionKind::input_grad:
        t.see(b.input_working < 0.0 ? b.working : b.input_working);
        break;
      case ActionKind::weight_grad:
        t.see(b.weight_working + step);
        break;
      default:
        break;
    }
    const std::size_t c = cell(a);
    double& own = own_[c];
    const double was = own;
    // One process (stages share their outputs): a checkpointed cell's `kept` is its own (its
    // replay's state); its inputs are the previous stage's output, which an offload moves off and
    // a reload brings back as the cell's own. Apart, `kept` is the cell's inputs.
    const double inputs = !one_process_ ? kept : a.stage > 0 ? bytes_of(a.stage - 1).output : 0.0;
    const double back = reloaded_[c] ? inputs : 0.0;
    switch (a.kind) {
      case ActionKind::forward:
        own = recomputed_[c] ? kept : b.forward - b.output;
        break;
      case ActionKind::recompute:
        own = b.forward + (one_process_ ? own : 0.0);
        break;
      case ActionKind::offload:
        if (!one_process_) own -= kept;
        offloaded_ += inputs;
        break;
      case ActionKind::reload:
        own += inputs;
        offloaded_ -= inputs;
        reloaded_[c] = 1;
        break;
      case ActionKind::input_grad:
        own = b.input_grad;
        if (one_process_ && recomputed_[c]) own += kept + (b.weight_reads_input ? back : 0.0);
        break;
      case ActionKind::weight_grad:
      case ActionKind::backward:
        own = 0.0;
        break;
    }
    const double before = t.now.activations;
    t.now.activations += own - was + made;
    // A forward's temporaries come on top of its whole cell as it ends (checkpointed or not: a
    // checkpointed forward frees what it does not keep only then); a recompute's on top of it.
    if (a.kind == ActionKind::forward) {
      // A checkpointed cell's replay state is taken before its forward runs.
      const double replay = one_process_ && recomputed_[c] ? kept : 0.0;
      t.see(std::max(0.0, before + replay + b.forward + b.forward_working - t.now.activations));
    }
    if (a.kind == ActionKind::recompute) t.see(b.forward_working);
    most_offloaded_ = std::max(most_offloaded_, offloaded_);
    if (weights && last && whole_grads) t.now.grads -= st.grads;
  }

  std::size_t cell(const Action& a) const {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(plan_.micro_batches) +
           static_cast<std::size_t>(a.micro);
  }
  const StageState& state_of(int s) const {
    return state_[state_.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  }
  const CellBytes& bytes_of(int s) const {
    return cells_[cells_.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  }

  const Plan& plan_;
  const std::vector<CellBytes>& cells_;
  const std::vector<StageState>& state_;
  bool fused_;
  std::vector<GradientSpan> spans_;
  SharedBytes shared_;
  std::vector<char> recomputed_;
  std::vector<double> own_;     // per cell of the walked worker
  std::vector<char> reloaded_;  // per cell: a reload brought its inputs back
  bool one_process_ = false;    // the stages share their outputs (CellBytes::output)
  double offloaded_ = 0, most_offloaded_ = 0;
};

}  // namespace detail

/// Per worker, the most bytes it holds at once in a step of `plan`, by what holds them, counted
/// along its program as `peak_bytes` counts its cells (`cells[s]` for stage s, or one entry for
/// all; a forward's temporaries on top of its whole cell, a checkpointed one's too), plus: its
/// stages' parameters and optimizer state (`state[s]`, or one entry for all) throughout; a
/// stage's gradients from its first B or W on, until its last with `fused` (the fused step frees
/// each gradient once stepped; a stage with one B holds them one at a time), else to the end of
/// the step, when the optimizer steps (its temporaries then count, on top of every gradient);
/// with `fused`, a stage's step temporaries during its last B or W. Gradients are taken as freed
/// between steps (`zero_grad(true)`, or the fused step). Where the cells share tensors between
/// stages (`CellBytes::output`, `sent_grad`: one process), each counts on the worker that made it
/// until the plan's messages guarantee every cell holding it let it go (`peak`: whatever the
/// workers' speeds), until its maker's actions that surely precede the release have run
/// (`least`), and, given the plan simulated on its costs (`timeline`), until the first of its
/// maker's actions that starts after the simulated release (`expected`).
///   auto w = stagewise::schedule::worker_memory(plan, {cell}, {state}, /*fused=*/true);
///   w[0].peak;  // bytes worker 0's device must hold
///   auto sim = stagewise::schedule::simulate(plan, costs);
///   worker_memory(plan, cells, states, true, sim.timeline)[0].expected;  // on that clock
inline std::vector<WorkerMemory> worker_memory(const Plan& plan,
                                               const std::vector<CellBytes>& cells,
                                               const std::vector<StageState>& state, bool fused,
                                               const Timeline& timeline = {}) {
  TORCH_CHECK(cells.size() == 1 || static_cast<int>(cells.size()) == plan.stages,
              "stagewise::schedule::worker_memory: give one CellBytes for every stage (",
              plan.stages, "), or one for all; got ", cells.size());
  TORCH_CHECK(state.size() == 1 || static_cast<int>(state.size()) == plan.stages,
              "stagewise::schedule::worker_memory: give one StageState for every stage (",
              plan.stages, "), or one for all; got ", state.size());
  detail::MemoryWalk walk(plan, cells, state, fused, &timeline);
  std::vector<WorkerMemory> out;
  for (int w = 0; w < plan.workers; ++w) out.push_back(walk.worker(w));
  return out;
}

}  // namespace stagewise::schedule
