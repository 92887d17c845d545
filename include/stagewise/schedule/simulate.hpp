#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/detail/replay.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// What each action costs on the simulator's clock, in the zero-bubble paper's terms: T_F is
/// `forward`, T_B is `input_grad` (the input-gradient part of backward, action I) and T_W is
/// `weight_grad` (action W); a full backward B costs T_B + T_W, a recompute R costs `recompute`
/// (negative: the same as `forward`); an offload O costs `offload` and a reload L `reload`
/// (negative: the same as `offload`) on the worker's copy lanes, beside its compute.
///   stagewise::schedule::Costs{.forward = 1, .input_grad = 1, .weight_grad = 1}  // the default
struct Costs {
  double forward = 1.0;
  double input_grad = 1.0;
  double weight_grad = 1.0;
  double recompute = -1.0;
  double offload = 0.0;
  double reload = -1.0;

  /// The cost of one action of kind `k`.
  double of(ActionKind k) const {
    switch (k) {
      case ActionKind::forward:
        return forward;
      case ActionKind::backward:
        return input_grad + weight_grad;
      case ActionKind::input_grad:
        return input_grad;
      case ActionKind::weight_grad:
        return weight_grad;
      case ActionKind::recompute:
        return recompute < 0.0 ? forward : recompute;
      case ActionKind::offload:
        return offload;
      case ActionKind::reload:
        return reload < 0.0 ? offload : reload;
    }
    return 0.0;
  }
  friend bool operator==(const Costs&, const Costs&) = default;
};

/// A simulated training step: the timeline and what it implies.
struct Simulation {
  Timeline timeline;  ///< every action with its simulated start and end, in cost units ("T")
  /// Per stage, the most micro-batches whose forward ran and whose last backward part (B, or W)
  /// had not: how many micro-batches of activations the stage holds at once.
  std::vector<int> peak_in_flight;
  /// Per worker, the same summed over the worker's stages (interleaved schedules).
  std::vector<int> worker_peak_in_flight;
  /// The most cells (micro-batch, stage) alive at once in the whole pipeline, over time: what a
  /// pipe whose stages share one memory (all on one CPU) holds at its peak.
  int total_peak_in_flight = 0;

  /// When the last action ends.
  double makespan() const { return timeline.span(); }
  /// Time worker `w` sits idle within the makespan.
  double idle(int w) const { return makespan() - timeline.busy(w); }
  /// The idle share of all workers' time (GPipe and 1F1B: (K-1)/(M+K-1)).
  double bubble() const { return timeline.bubble(); }
  /// The largest of `peak_in_flight`.
  int max_in_flight() const {
    return peak_in_flight.empty() ? 0
                                  : *std::max_element(peak_in_flight.begin(), peak_in_flight.end());
  }
};

/// What one cell (micro-batch, stage) holds, for `peak_bytes`: from its F until its backward,
/// `forward` (the activations its backward needs); from its I until its W, `input_grad` (what the
/// weight gradient still needs: each layer's input and output gradient). A full B frees the cell
/// at once. While a backward runs it allocates more (gradients of activations, each weight
/// gradient before it is added in): `working` above the cell's bytes during a B (and an I, unless
/// `input_working` is given), `weight_working` above them during a W (on the first stage, whose
/// input needs no gradient, I has nothing to do and W runs the whole backward), and
/// `forward_working` during an F or an R (a forward's temporaries, e.g. a convolution's unfolded
/// input). Measure them on one stage alone: a forward and a backward; a forward,
/// SplitBackward::input_grad and weight_grad (`profile_stages` does).
/// A checkpointed cell (one with an R in the plan) holds `kept` from its F to its R (its inputs;
/// negative: `forward`, as if it kept everything), and `forward` from its R on; an offload O
/// takes its `kept` bytes off the device until its reload L.
/// The last four fields describe tensors two stages share where their workers share one memory
/// (one process, one device: a stage's output is the next stage's input, not a copy of it);
/// `schedule::worker_memory` counts them on the worker that made them for as long as either
/// stage holds them, `peak_bytes` does not. Zero: nothing shared (separate devices).
///   stagewise::schedule::CellBytes{.forward = 131072, .input_grad = 262144, .working = 131584}
struct CellBytes {
  double forward = 1.0;
  double input_grad = 1.0;
  double working = 0.0;
  double weight_working = 0.0;
  double kept = -1.0;
  double forward_working = 0.0;  ///< above the cell during its F or R
  double input_working = -1.0;   ///< above the cell during its I (negative: `working`)
  /// The part of `forward` that is the stage's output, which the next stage's cell holds as its
  /// input: on this worker until both cells let it go (a checkpointed cell keeps none of its
  /// forward's output; the next stage's cell holds it until its B, its I, its W when
  /// `weight_reads_input`, or its offload). A cell whose input is shared this way keeps no
  /// bytes of its own from its F to its R; after a reload, its `kept` inputs are its own.
  double output = 0.0;
  /// The gradient of the cell's inputs, made by its B or I and sent to the previous stage: on
  /// this worker until that stage's B, its I, or its W when it `weight_reads_grad`.
  double sent_grad = 0.0;
  /// The cell's W reads its inputs (a Linear's weight gradient reads the Linear's input).
  bool weight_reads_input = false;
  /// The cell's W starts from the gradient it received (its input needs none, so its I has
  /// nothing to do), which then lives until its W.
  bool weight_reads_grad = false;
};

/// Per worker, the most bytes its stages' cells hold at once (no checkpointing: a cell keeps its
/// activations from F to its backward), counted along the worker's program, which is exact since
/// a worker performs its actions in order: + forward at F, + (input_grad - forward) at I,
/// - input_grad at W, - forward at B; a checkpointed cell + kept at F, + (forward - kept) at R,
/// and - kept at its O, + kept at its L (an offload's bytes leave when it is issued: an upper
/// bound on the saving, since a CUDA copy frees them only once it has landed). `bytes[s]` for stage
/// s, or one entry for every stage; with `CellBytes{}` this is `Simulation::worker_peak_in_flight`.
/// While an F, an R, a B, an I or a W runs, its working bytes count too.
///   auto peak = stagewise::schedule::peak_bytes(plan, {{131072, 196608}});
inline std::vector<double> peak_bytes(const Plan& plan, const std::vector<CellBytes>& bytes) {
  TORCH_CHECK(bytes.size() == 1 || static_cast<int>(bytes.size()) == plan.stages,
              "stagewise::schedule::peak_bytes: give one CellBytes for every stage (",
              plan.stages, "), or one for all; got ", bytes.size());
  // The cells with a recompute keep only `kept` until it.
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
  std::vector<double> peaks;
  for (const auto& program : plan.programs) {
    double now = 0.0;
    double peak = 0.0;
    for (const auto& a : program) {
      const auto& b = bytes[bytes.size() == 1 ? 0 : static_cast<std::size_t>(a.stage)];
      const double kept = b.kept < 0.0 ? b.forward : b.kept;
      if (a.kind == ActionKind::backward) peak = std::max(peak, now + b.working);
      if (a.kind == ActionKind::input_grad) {
        peak = std::max(peak, now + (b.input_working < 0.0 ? b.working : b.input_working));
      }
      if (a.kind == ActionKind::weight_grad) peak = std::max(peak, now + b.weight_working);
      if (a.kind == ActionKind::forward || a.kind == ActionKind::recompute) {
        peak = std::max(peak, now + b.forward_working);
      }
      if (a.kind == ActionKind::forward) now += recomputed[cell(a)] ? kept : b.forward;
      if (a.kind == ActionKind::recompute) now += b.forward - kept;
      if (a.kind == ActionKind::offload) now -= kept;
      if (a.kind == ActionKind::reload) now += kept;
      if (a.kind == ActionKind::input_grad) now += b.input_grad - b.forward;
      if (a.kind == ActionKind::weight_grad) now -= b.input_grad;
      if (a.kind == ActionKind::backward) now -= b.forward;
      peak = std::max(peak, now);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

/// Runs a plan on a virtual clock with each action's own cost: `cost(action)` says how long that
/// action takes (e.g. the time it took in a recorded step, to ask what the schedule alone implies
/// for those durations). Everything else as `simulate(plan, costs)`.
///   std::map<std::string, double> took;   // from a recorded Timeline: to_string(action) -> ms
///   auto sim = stagewise::schedule::simulate(
///       plan, [&](const stagewise::schedule::Action& a) { return took.at(to_string(a)); });
template <class Cost>
  requires std::is_invocable_r_v<double, const Cost&, const Action&>
Simulation simulate(const Plan& plan, const Cost& cost) {
  detail::Dependencies deps(plan.stages, plan.micro_batches);
  auto r = detail::replay(plan.programs, deps, [&](const Action& a) {
    const double c = cost(a);
    TORCH_CHECK(c >= 0.0, "stagewise::schedule::simulate: the cost of ", to_string(a), " is ", c,
                "; give costs of 0 or more");
    return c;
  });
  TORCH_CHECK(r.complete,
              "stagewise::schedule::simulate: the plan deadlocks; build it with "
              "stagewise::schedule::plan, which verifies the schedule");
  Simulation sim;
  sim.timeline.stages = plan.stages;
  sim.timeline.micro_batches = plan.micro_batches;
  sim.timeline.workers = plan.workers;
  sim.timeline.unit = "T";
  sim.timeline.actions = std::move(r.timed);
  std::stable_sort(sim.timeline.actions.begin(), sim.timeline.actions.end(),
                   [](const TimedAction& x, const TimedAction& y) { return x.start < y.start; });
  // In flight: +1 at F, -1 at the cell's last backward part. A worker performs its stages'
  // actions in program order, so counting along the program is exact; per worker, that is
  // peak_bytes with a cell of 1.
  sim.peak_in_flight.assign(static_cast<std::size_t>(plan.stages), 0);
  std::vector<int> now(static_cast<std::size_t>(plan.stages), 0);
  for (const auto& program : plan.programs) {
    for (const auto& a : program) {
      auto& n = now[static_cast<std::size_t>(a.stage)];
      if (a.kind == ActionKind::forward) ++n;
      if (a.kind == ActionKind::backward || a.kind == ActionKind::weight_grad) --n;
      auto& peak = sim.peak_in_flight[static_cast<std::size_t>(a.stage)];
      peak = std::max(peak, n);
    }
  }
  for (double cells : peak_bytes(plan, {CellBytes{}})) {
    sim.worker_peak_in_flight.push_back(static_cast<int>(cells));
  }
  // Over the whole pipeline, in time: a cell lives from its F's start to its last part's end.
  std::vector<std::pair<double, int>> events;
  for (const auto& t : sim.timeline.actions) {
    if (t.action.kind == ActionKind::forward) events.emplace_back(t.start, 1);
    if (t.action.kind == ActionKind::backward || t.action.kind == ActionKind::weight_grad) {
      events.emplace_back(t.end, -1);
    }
  }
  std::sort(events.begin(), events.end());  // at equal times, ends (-1) before starts
  int alive = 0;
  for (const auto& e : events) {
    alive += e.second;
    sim.total_peak_in_flight = std::max(sim.total_peak_in_flight, alive);
  }
  return sim;
}

/// Runs a plan on a virtual clock: every worker performs its actions in order, each as soon as
/// its worker is free and its inputs exist (the activation from the previous stage, the gradient
/// from the next), taking `costs.of(kind)`; messages take no time.
inline Simulation simulate(const Plan& plan, const Costs& costs = {}) {
  for (auto k : {ActionKind::forward, ActionKind::input_grad, ActionKind::weight_grad,
                 ActionKind::recompute, ActionKind::offload, ActionKind::reload}) {
    TORCH_CHECK(costs.of(k) >= 0.0, "stagewise::schedule::simulate: the cost of ",
                std::string(1, static_cast<char>(k)), " is ", costs.of(k),
                "; give costs of 0 or more");
  }
  return simulate(plan, [&](const Action& a) { return costs.of(a.kind); });
}

/// Simulates schedule `sched` for `stages` stages and `micro_batches` micro-batches (the first
/// `checkpointed` of them recomputed before their backward), after verifying it.
///   auto sim = stagewise::schedule::simulate(stagewise::schedule::one_f_one_b{}, 4, 8);
///   sim.bubble();          // 3/11, as (K-1)/(M+K-1)
///   sim.peak_in_flight[0]; // 4, K (GPipe: 8, M)
template <pipeline_schedule S>
Simulation simulate(const S& sched, int stages, int micro_batches, const Costs& costs = {},
                    int checkpointed = 0) {
  return simulate(plan(sched, stages, micro_batches, checkpointed), costs);
}

}  // namespace stagewise::schedule
