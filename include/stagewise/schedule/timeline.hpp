#pragma once

#include "stagewise/schedule/action.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

namespace stagewise::schedule {

/// One action as it ran (or would run): on which worker, from `start` to `end`, after waiting
/// `waited` for what it consumes (the activation or gradient message; 0 when it was there).
struct TimedAction {
  Action action;
  int worker = 0;
  double start = 0.0;
  double end = 0.0;
  double waited = 0.0;
};

/// The actions of a training step laid out in time, simulated (`simulate`, in cost units) or
/// recorded (`train_step(..., &timeline)`, in microseconds). Draw it with `to_svg` or open
/// `to_chrome_trace`'s JSON in Perfetto.
///   stagewise::schedule::Timeline t = stagewise::schedule::simulate(one_f_one_b{}, 4, 8).timeline;
///   double idle_share = t.bubble();
struct Timeline {
  int stages = 0;
  int micro_batches = 0;
  int workers = 0;
  std::string unit = "us";  ///< what `start` and `end` count: "us", or "T" for cost units
  std::vector<TimedAction> actions;

  /// When the first action started.
  double begin() const {
    double t = std::numeric_limits<double>::infinity();
    for (const auto& a : actions) t = std::min(t, a.start);
    return actions.empty() ? 0.0 : t;
  }
  /// From the first start to the last end (the makespan).
  double span() const {
    double t = -std::numeric_limits<double>::infinity();
    for (const auto& a : actions) t = std::max(t, a.end);
    return actions.empty() ? 0.0 : t - begin();
  }
  /// Time worker `w` spent running actions (compute: copies, O and L, run beside it).
  double busy(int w) const {
    double t = 0.0;
    for (const auto& a : actions) {
      if (a.worker == w && !is_copy(a.action.kind)) t += a.end - a.start;
    }
    return t;
  }
  /// Time worker `w` spent waiting for messages (activations, gradients) before its actions.
  double waiting(int w) const {
    double t = 0.0;
    for (const auto& a : actions) {
      if (a.worker == w && !is_copy(a.action.kind)) t += a.waited;
    }
    return t;
  }
  /// The share of all workers' time spent waiting for messages:
  /// sum(waiting) / (workers * span). Unlike `bubble`, it leaves out the time after a worker's
  /// last action (it waits for nothing) and, in a recorded step, the time lost between actions
  /// to the executor's bookkeeping or to a busy machine; compare it with the same share of a
  /// simulation fed the measured costs.
  ///   sched::simulate(sched::one_f_one_b{}, 2, 2).timeline.waiting_share();  // 4/18
  double waiting_share() const {
    const double total = span() * workers;
    if (total <= 0.0) return 0.0;
    double waited = 0.0;
    for (int w = 0; w < workers; ++w) waited += waiting(w);
    return waited / total;
  }
  /// The idle share of all workers' time over the span: 1 - sum(busy) / (workers * span).
  double bubble() const {
    const double total = span() * workers;
    if (total <= 0.0) return 0.0;
    double used = 0.0;
    for (int w = 0; w < workers; ++w) used += busy(w);
    return 1.0 - used / total;
  }
};

}  // namespace stagewise::schedule
