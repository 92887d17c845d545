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
  double optimizer = 0;
  double step_working = 0;
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
  auto cell_of = [&](int s) -> const CellBytes& {
    return cells[cells.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  };
  auto state_of = [&](int s) -> const StageState& {
    return state[state.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  };
  std::vector<char> recomputed(
      static_cast<std::size_t>(plan.stages) * static_cast<std::size_t>(plan.micro_batches), 0);
  auto cell = [&](const Action& a) {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(plan.micro_batches) +
           static_cast<std::size_t>(a.micro);
  };
  for (const auto& program : plan.programs) {
    for (const auto& a : program) {
      if (a.kind == ActionKind::recompute) recomputed[cell(a)] = 1;
    }
  }
  const auto spans = detail::gradient_spans(plan);
  std::vector<WorkerMemory> out;
  for (int w = 0; w < plan.workers; ++w) {
    const auto& program = plan.programs[static_cast<std::size_t>(w)];
    detail::WorkerTally t;
    double step_working = 0;  // the largest of the worker's stages' (the unfused step's)
    for (int s : plan.stages_of(w)) {
      t.now.params += state_of(s).params;
      t.now.optimizer += state_of(s).optimizer;
      step_working = std::max(step_working, state_of(s).step_working);
    }
    double offloaded = 0, most_offloaded = 0;
    t.see(0);
    for (std::size_t k = 0; k < program.size(); ++k) {
      const Action& a = program[k];
      const auto& b = cell_of(a.stage);
      const auto& st = state_of(a.stage);
      const auto& span = spans[static_cast<std::size_t>(a.stage)];
      const double kept = b.kept < 0.0 ? b.forward : b.kept;
      const bool weights = a.kind == ActionKind::backward || a.kind == ActionKind::weight_grad;
      if (weights && static_cast<int>(k) == span.first) t.now.grads += st.grads;
      if (a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) {
        double working = b.working;
        if (fused && static_cast<int>(k) == span.last && a.kind == ActionKind::backward) {
          working += st.step_working;
        }
        t.see(working);
      }
      if (a.kind == ActionKind::weight_grad) {
        t.see(b.weight_working +
              (fused && static_cast<int>(k) == span.last ? st.step_working : 0.0));
      }
      auto& acts = t.now.activations;
      if (a.kind == ActionKind::forward) acts += recomputed[cell(a)] ? kept : b.forward;
      if (a.kind == ActionKind::recompute) acts += b.forward - kept;
      if (a.kind == ActionKind::offload) {
        acts -= kept;
        offloaded += kept;
      }
      if (a.kind == ActionKind::reload) {
        acts += kept;
        offloaded -= kept;
      }
      if (a.kind == ActionKind::input_grad) acts += b.input_grad - b.forward;
      if (a.kind == ActionKind::weight_grad) acts -= b.input_grad;
      if (a.kind == ActionKind::backward) acts -= b.forward;
      most_offloaded = std::max(most_offloaded, offloaded);
      if (weights && fused && static_cast<int>(k) == span.last) t.now.grads -= st.grads;
      t.see(0);
    }
    if (!fused) t.see(step_working);  // the optimizer's step, after the pipeline's
    out.push_back(t.at_peak);
    out.back().offloaded = most_offloaded;
  }
  return out;
}

}  // namespace stagewise::schedule
