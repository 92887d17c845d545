#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"

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

/// A worker's bytes at its peak, by what holds them; `peak` is their sum: what the worker's
/// device must hold. `offloaded` is the most bytes its cells had in the store at once (host
/// memory or files, not counted in `peak`).
struct WorkerMemory {
  double params = 0;
  double grads = 0;
  double optimizer = 0;
  double activations = 0;  ///< what the cells keep: whole, or a checkpointed cell's inputs
  double working = 0;      ///< the running action's working memory, or the step's temporaries
  double peak = 0;
  double offloaded = 0;
  /// Its stages' optimizer state off the device (not counted in `peak`), and the bytes that
  /// offload moves per step (`StageState::optimizer_offloaded`, `moved`).
  double optimizer_offloaded = 0;
  double moved = 0;
};

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
             const std::vector<StageState>& state, bool fused)
      : plan_(plan), cells_(cells), state_(state), fused_(fused), spans_(gradient_spans(plan)) {
    recomputed_.assign(
        static_cast<std::size_t>(plan.stages) * static_cast<std::size_t>(plan.micro_batches), 0);
    for (const auto& program : plan.programs) {
      for (const auto& a : program) {
        if (a.kind == ActionKind::recompute) recomputed_[cell(a)] = 1;
      }
    }
  }

  WorkerMemory worker(int w) {
    WorkerTally t;
    double step_working = 0;  // the largest of the worker's stages' (the unfused step's)
    for (int s : plan_.stages_of(w)) {
      t.now.params += state_of(s).params;
      t.now.optimizer += state_of(s).optimizer;
      step_working = std::max(step_working, state_of(s).step_working);
    }
    offloaded_ = most_offloaded_ = 0;
    t.see(0);
    const auto& program = plan_.programs[static_cast<std::size_t>(w)];
    for (std::size_t k = 0; k < program.size(); ++k) act(program[k], static_cast<int>(k), t);
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
  // what it keeps or frees.
  void act(const Action& a, int k, WorkerTally& t) {
    const auto& b = cells_[cells_.size() == 1 ? 0 : static_cast<std::size_t>(a.stage)];
    const auto& st = state_of(a.stage);
    const auto& span = spans_[static_cast<std::size_t>(a.stage)];
    const double kept = b.kept < 0.0 ? b.forward : b.kept;
    const bool weights = a.kind == ActionKind::backward || a.kind == ActionKind::weight_grad;
    const bool last = fused_ && k == span.last;  // the fused step steps the stage here
    if (weights && k == span.first) t.now.grads += st.grads;
    if (a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) {
      t.see(b.working + (last && a.kind == ActionKind::backward ? st.step_working : 0.0));
    }
    if (a.kind == ActionKind::weight_grad) t.see(b.weight_working + (last ? st.step_working : 0.0));
    auto& acts = t.now.activations;
    switch (a.kind) {
      case ActionKind::forward: acts += recomputed_[cell(a)] ? kept : b.forward; break;
      case ActionKind::recompute: acts += b.forward - kept; break;
      case ActionKind::offload: acts -= kept; offloaded_ += kept; break;
      case ActionKind::reload: acts += kept; offloaded_ -= kept; break;
      case ActionKind::input_grad: acts += b.input_grad - b.forward; break;
      case ActionKind::weight_grad: acts -= b.input_grad; break;
      case ActionKind::backward: acts -= b.forward; break;
    }
    most_offloaded_ = std::max(most_offloaded_, offloaded_);
    if (weights && last) t.now.grads -= st.grads;
    t.see(0);
  }

  std::size_t cell(const Action& a) const {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(plan_.micro_batches) +
           static_cast<std::size_t>(a.micro);
  }
  const StageState& state_of(int s) const {
    return state_[state_.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  }

  const Plan& plan_;
  const std::vector<CellBytes>& cells_;
  const std::vector<StageState>& state_;
  bool fused_;
  std::vector<GradientSpan> spans_;
  std::vector<char> recomputed_;
  double offloaded_ = 0, most_offloaded_ = 0;
};

}  // namespace detail

/// Per worker, the most bytes it holds at once in a step of `plan`, by what holds them, counted
/// along its program as `peak_bytes` counts its cells (`cells[s]` for stage s, or one entry for
/// all), plus: its stages' parameters and optimizer state (`state[s]`, or one entry for all)
/// throughout; a stage's gradients from its first B or W on, until its last with `fused` (the
/// fused step frees each gradient once stepped), else to the end of the step, when the optimizer
/// steps (its temporaries then count, on top of every gradient); with `fused`, a stage's step
/// temporaries during its last B or W. Gradients are taken as freed between steps
/// (`zero_grad(true)`, or the fused step).
///   auto w = stagewise::schedule::worker_memory(plan, {cell}, {state}, /*fused=*/true);
///   w[0].peak;  // bytes worker 0's device must hold
inline std::vector<WorkerMemory> worker_memory(const Plan& plan, const std::vector<CellBytes>& cells,
                                               const std::vector<StageState>& state, bool fused) {
  TORCH_CHECK(cells.size() == 1 || static_cast<int>(cells.size()) == plan.stages,
              "stagewise::schedule::worker_memory: give one CellBytes for every stage (",
              plan.stages, "), or one for all; got ", cells.size());
  TORCH_CHECK(state.size() == 1 || static_cast<int>(state.size()) == plan.stages,
              "stagewise::schedule::worker_memory: give one StageState for every stage (",
              plan.stages, "), or one for all; got ", state.size());
  detail::MemoryWalk walk(plan, cells, state, fused);
  std::vector<WorkerMemory> out;
  for (int w = 0; w < plan.workers; ++w) out.push_back(walk.worker(w));
  return out;
}

}  // namespace stagewise::schedule
