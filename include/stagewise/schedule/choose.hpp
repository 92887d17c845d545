#pragma once

#include "stagewise/core/error_context.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/builtins.hpp"
#include "stagewise/schedule/concepts.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// How much activation memory each worker (a device) may hold, for `choose`: a number of
/// micro-batches of the worker's whole share of the model (1F1B's stage 0 holds K of them; a V
/// schedule's cell is half of one), or bytes. In bytes, give what one micro-batch keeps on each
/// worker's whole share: one number (kept from its forward to its last backward part), or its
/// `CellBytes` (`cell_bytes`: kept before and after an I, and a backward's working memory;
/// measured on one stage alone, e.g. with benchmarks/common/cell_bytes.hpp), which `peak_bytes`
/// turns into each worker's peak. A schedule with v stages per worker gets 1/v of them per stage.
///   stagewise::schedule::ActivationLimit::micro_batches(3)
///   stagewise::schedule::ActivationLimit::bytes(6LL << 30, {512LL << 20})  // 6 GiB, 512 MiB
struct ActivationLimit {
  /// At most `n` micro-batches of a worker's share of the model on every worker.
  static ActivationLimit micro_batches(double n) {
    TORCH_CHECK(n > 0, "stagewise::schedule::ActivationLimit::micro_batches: the limit is ", n,
                "; give a positive number of micro-batches");
    ActivationLimit l;
    l.limit_micro_batches = n;
    return l;
  }
  /// At most `limit` bytes of activations on every worker, where one micro-batch keeps
  /// `per_micro_batch[w]` bytes on worker w's share (one entry: the same on every worker) from
  /// its forward to its last backward part.
  static ActivationLimit bytes(std::int64_t limit, const std::vector<std::int64_t>& per_micro_batch) {
    std::vector<CellBytes> cells;
    for (auto b : per_micro_batch) {
      TORCH_CHECK(b > 0, "stagewise::schedule::ActivationLimit::bytes: one micro-batch takes ", b,
                  " bytes on a worker; give positive sizes (profile a step to measure them)");
      cells.push_back({static_cast<double>(b), static_cast<double>(b), 0.0, 0.0});
    }
    return cell_bytes(limit, std::move(cells));
  }
  /// At most `limit` bytes on every worker, with what one micro-batch keeps and works with on
  /// worker w's whole share: `per_worker[w]` (one entry: the same on every worker).
  ///   ActivationLimit::cell_bytes(6LL << 30, {CellBytes{512e6, 1e9, 64e6, 64e6}})
  static ActivationLimit cell_bytes(std::int64_t limit, std::vector<CellBytes> per_worker) {
    TORCH_CHECK(limit > 0, "stagewise::schedule::ActivationLimit::bytes: the limit is ", limit,
                " bytes; give a positive number");
    TORCH_CHECK(!per_worker.empty(),
                "stagewise::schedule::ActivationLimit::bytes: give the bytes of one micro-batch's "
                "activations on each worker (or one number for all)");
    ActivationLimit l;
    l.limit_bytes = limit;
    l.per_worker = std::move(per_worker);
    return l;
  }
  /// No limit: `choose` then returns the fastest schedule.
  static ActivationLimit none() { return {}; }

  double limit_micro_batches = std::numeric_limits<double>::infinity();
  std::int64_t limit_bytes = 0;  ///< 0: the limit is in micro-batches
  std::vector<CellBytes> per_worker;

  /// What a stage keeps on worker `w` when each worker runs `v` stages.
  CellBytes stage_on(int w, int v) const {
    const auto& c = per_worker[std::min(static_cast<std::size_t>(w), per_worker.size() - 1)];
    return {c.forward / v, c.input_grad / v, c.working / v, c.weight_working / v};
  }
};

/// One schedule `choose` may pick: the schedule, and how many stages it runs on each worker
/// (1, or 2 for the V-shaped and interleaved{2} ones): the pipe is cut into that many times the
/// workers.
struct ScheduleCandidate {
  any_schedule schedule;
  int stages_per_worker = 1;

  /// `s` under its own name, with its own stages per worker (`stages_per_worker_of`).
  ///   ScheduleCandidate::of(stagewise::schedule::looped_bfs{2})  // "looped_bfs{2}", 2
  template <named_schedule S>
  static ScheduleCandidate of(const S& s) {
    return {any_schedule(s), stages_per_worker_of(s)};
  }
};

/// The schedules `choose` weighs by default: the built-ins (`builtin_schedules`) but those that
/// say `default_candidate = false` (looped BFS), in the list's order: GPipe, 1F1B, ZB-H1,
/// interleaved 1F1B (2 per worker), ZB-V, DualPipeV, V-Half and V-Min.
inline std::vector<ScheduleCandidate> default_candidates() {
  std::vector<ScheduleCandidate> out;
  for_each_schedule([&](const auto& s) {
    if (default_candidate(s)) out.push_back(ScheduleCandidate::of(s));
  });
  return out;
}

/// How one candidate fared on the simulator's clock.
struct ScheduleEstimate {
  std::string name;
  int stages = 0;           ///< stages to cut the model into (workers x stages per worker)
  double makespan = 0;      ///< simulated step time, in the costs' unit
  double bubble = 0;        ///< idle share of all workers' time
  /// Per worker, the most activations held at once, in micro-batches of the worker's share.
  std::vector<double> peak_micro_batches;
  /// Per worker, the most bytes held at once (`peak_bytes`; bytes limits only, else empty).
  std::vector<double> peak_bytes;
  bool fits = false;
  std::string why_not;  ///< why it was rejected ("" if it fits)
};

/// `choose`'s answer: the fastest schedule that fits, with its simulation, and every other
/// candidate with its figures (faster ones with why they were rejected).
struct Choice {
  any_schedule schedule;  ///< give it to train_step
  int stages = 0;         ///< cut the model into this many stages (sw::even_balance(n, stages))
  Simulation simulation;  ///< the chosen plan on the simulator's clock
  ScheduleEstimate chosen;
  /// Every candidate, fastest first (the chosen one included).
  std::vector<ScheduleEstimate> all;

  /// The faster candidates that did not fit, each with why: "zero_bubble_v: 26 (bubble 0.077),
  /// worker 0 holds 4 micro-batches, over the limit of 3".
  std::vector<std::string> rejected() const {
    std::vector<std::string> out;
    for (const auto& e : all) {
      if (e.name == chosen.name) break;
      out.push_back(e.name + ": " + e.why_not);
    }
    return out;
  }
  /// A table of every candidate: step time, bubble, worst peak and the verdict.
  std::string report() const {
    std::ostringstream out;
    out.precision(4);
    for (const auto& e : all) {
      const double peak = e.peak_micro_batches.empty()
                              ? 0.0
                              : *std::max_element(e.peak_micro_batches.begin(),
                                                  e.peak_micro_batches.end());
      out << (e.name == chosen.name ? "* " : "  ") << e.name << ": " << e.stages << " stages, step "
          << e.makespan << ", bubble " << e.bubble << ", peak " << peak << " micro-batches"
          << (e.fits ? "" : " - rejected: " + e.why_not) << "\n";
    }
    return out.str();
  }
};

namespace detail {

inline std::string number(double x) {
  std::ostringstream out;
  out.precision(4);
  out << x;
  return out.str();
}

// Simulates one candidate and judges it against the limit; its simulation goes to `*sim_out`
// (untouched when the schedule cannot run here).
inline ScheduleEstimate estimate(const ScheduleCandidate& c, int workers, int micro_batches,
                                 const Costs& costs, const ActivationLimit& limit,
                                 Simulation* sim_out) {
  ScheduleEstimate e;
  e.name = c.schedule.name();
  e.stages = workers * c.stages_per_worker;
  const double v = c.stages_per_worker;
  const Costs part{costs.forward / v, costs.input_grad / v, costs.weight_grad / v,
                   costs.recompute < 0 ? -1.0 : costs.recompute / v};
  Plan p;
  Simulation sim;
  try {
    p = plan(c.schedule, e.stages, micro_batches);
    sim = simulate(p, part);
  } catch (const std::exception& ex) {
    e.why_not = std::string("cannot run here: ") + ::stagewise::detail::message_of(ex);
    e.makespan = std::numeric_limits<double>::infinity();
    return e;
  }
  e.makespan = sim.makespan();
  e.bubble = sim.bubble();
  for (int peak : sim.worker_peak_in_flight) e.peak_micro_batches.push_back(peak / v);
  e.fits = true;
  if (limit.limit_bytes > 0) {
    std::vector<CellBytes> per_stage;
    for (int s = 0; s < e.stages; ++s) {
      per_stage.push_back(limit.stage_on(p.worker_of(s), c.stages_per_worker));
    }
    e.peak_bytes = peak_bytes(p, per_stage);
  }
  for (int w = 0; w < workers && e.fits; ++w) {
    const double held = e.peak_micro_batches[static_cast<std::size_t>(w)];
    const std::string at = "; worker " + std::to_string(w) + " holds " + number(held) +
                           " micro-batches";
    if (limit.limit_bytes > 0) {
      const double b = e.peak_bytes[static_cast<std::size_t>(w)];
      if (b > static_cast<double>(limit.limit_bytes)) {
        e.fits = false;
        e.why_not = "step " + number(e.makespan) + at + ", " + number(b) +
                    " bytes, over the limit of " + std::to_string(limit.limit_bytes);
      }
    } else if (held > limit.limit_micro_batches + 1e-9) {
      e.fits = false;
      e.why_not = "step " + number(e.makespan) + at + ", over the limit of " +
                  number(limit.limit_micro_batches);
    }
  }
  *sim_out = std::move(sim);
  return e;
}

}  // namespace detail

/// The fastest schedule whose simulated peak activations fit `limit` on every worker, for
/// `workers` workers (devices, or ranks) and `micro_batches` micro-batches, with `costs` the
/// cost of F, I (input gradient) and W (weight gradient) of one micro-batch on one worker's whole
/// share of the model (measured: a recorded Timeline's mean action times; a schedule with two
/// stages per worker costs half of it per stage). Ties go to the earlier candidate. Throws,
/// naming every candidate's peak, when none fits.
///   auto c = stagewise::schedule::choose(4, 8, {}, ActivationLimit::micro_batches(2));
///   c.schedule.name();  // "v_min": 1F1B, ZB-V and V-Half hold 4, 4 and 3 micro-batches
///   auto pipe = sw::Pipe(seq, sw::even_balance(seq->size(), c.stages), opts);
///   pipe->train_step(x, y, loss_fn, c.schedule);
inline Choice choose(int workers, int micro_batches, const Costs& costs,
                     const ActivationLimit& limit,
                     const std::vector<ScheduleCandidate>& candidates = default_candidates()) {
  TORCH_CHECK(workers >= 1 && micro_batches >= 1, "stagewise::schedule::choose: ", workers,
              " workers and ", micro_batches, " micro-batches; give 1 or more of each");
  TORCH_CHECK(!candidates.empty(), "stagewise::schedule::choose: no candidate schedules; leave "
              "the argument out for the built-in ones");
  std::vector<std::pair<ScheduleEstimate, std::size_t>> all;
  std::vector<Simulation> sims(candidates.size());
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    all.emplace_back(detail::estimate(candidates[i], workers, micro_batches, costs, limit, &sims[i]),
                     i);
  }
  std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.first.makespan < b.first.makespan;
  });
  Choice choice{candidates.front().schedule, 0, {}, {}, {}};
  std::size_t best = candidates.size();
  for (const auto& [e, i] : all) {
    if (best == candidates.size() && e.fits) {
      best = i;
      choice.chosen = e;
    }
    choice.all.push_back(e);
  }
  if (best == candidates.size()) {
    std::string why;
    for (const auto& e : choice.all) why += "\n  " + e.name + ": " + e.why_not;
    TORCH_CHECK(false, "stagewise::schedule::choose: no schedule fits the activation limit on ",
                workers, " workers with ", micro_batches, " micro-batches:", why,
                "\nRaise the limit, checkpoint (each cell then keeps only its input), offload, or "
                "use more, smaller micro-batches (V-Min's peak does not grow with them)");
  }
  choice.schedule = candidates[best].schedule;
  choice.simulation = std::move(sims[best]);
  choice.stages = choice.chosen.stages;
  return choice;
}

}  // namespace stagewise::schedule
