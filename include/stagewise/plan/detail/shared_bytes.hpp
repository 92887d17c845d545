#pragma once

// The tensors two stages share where their workers share one memory, for schedule::worker_memory
// (CellBytes::output, sent_grad): a stage's output, which the next stage's cell holds as its
// input, and the gradient a cell sends back, which the previous stage's cell holds until it has
// used it. Each is counted on the worker that made it from the action that made it until the
// first action of that worker which, by the plan's messages, starts after every cell holding it
// let it go (detail/causal_order.hpp): an upper bound, whatever the workers' speeds.

#include "stagewise/plan/detail/causal_order.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <vector>

namespace stagewise::schedule::detail {

// Per worker and action: the shared bytes that come onto the worker when the action ends
// (`after[w][k]`), and those that leave it before the action starts (`before[w][k]`; index
// programs[w].size(): at the end of the step), as the plan's messages guarantee; `soonest`: as
// early as they may (once the worker's actions that surely precede the last release have run);
// `expected`: as a simulated clock has it (none without a clock).
struct SharedBytes {
  std::vector<std::vector<double>> after;
  std::vector<std::vector<double>> before;
  std::vector<std::vector<double>> soonest;
  std::vector<std::vector<double>> expected;
};

// When each worker's actions start on a simulated clock (`timeline`, the plan simulated on
// its actions' costs), and the first of a worker's actions after `made` that starts once a
// release at time `t` is over: where the clock puts a shared tensor's end.
class SimulatedStarts {
 public:
  SimulatedStarts(const Plan& plan, const CellPlaces& places, const Timeline& timeline) {
    for (const auto& program : plan.programs) starts_.emplace_back(program.size(), 0.0);
    ends_ = starts_;
    for (const auto& t : timeline.actions) {
      const auto& place = places.of(t.action.kind)[places.cell(t.action.stage, t.action.micro)];
      if (!place.exists()) continue;
      starts_[static_cast<std::size_t>(place.worker)][static_cast<std::size_t>(place.index)] =
          t.start;
      ends_[static_cast<std::size_t>(place.worker)][static_cast<std::size_t>(place.index)] = t.end;
    }
    // Copies start on their own lane: a worker's starts, as they are issued, only grow.
    for (auto& s : starts_) {
      for (std::size_t k = 1; k < s.size(); ++k) s[k] = std::max(s[k], s[k - 1]);
    }
  }
  double end(int w, int k) const {
    return ends_[static_cast<std::size_t>(w)][static_cast<std::size_t>(k)];
  }
  std::size_t first_from(int w, double t) const {
    const auto& s = starts_[static_cast<std::size_t>(w)];
    return static_cast<std::size_t>(std::lower_bound(s.begin(), s.end(), t) - s.begin());
  }

 private:
  std::vector<std::vector<double>> starts_;
  std::vector<std::vector<double>> ends_;
};

inline SharedBytes shared_bytes(const Plan& plan, const std::vector<CellBytes>& cells,
                                const Timeline* timeline = nullptr) {
  SharedBytes out;
  for (const auto& program : plan.programs) {
    out.after.emplace_back(program.size(), 0.0);
    out.before.emplace_back(program.size() + 1, 0.0);
  }
  out.soonest = out.before;
  auto bytes = [&](int s) -> const CellBytes& {
    return cells[cells.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  };
  bool any = false;
  for (int s = 0; s < plan.stages; ++s) any = any || bytes(s).output > 0 || bytes(s).sent_grad > 0;
  if (!any) return out;
  const CellPlaces places(plan);
  const CausalOrder order(plan, places);
  std::optional<SimulatedStarts> clock;
  if (timeline != nullptr && !timeline->actions.empty()) {
    clock.emplace(plan, places, *timeline);
    out.expected = out.before;
  }
  using Place = CellPlaces::Place;
  // `n` bytes made by `made`, freed once every one of `holders` has ended: for sure, and on the
  // clock.
  auto hold = [&](double n, Place made, std::initializer_list<Place> holders) {
    if (n <= 0 || !made.exists()) return;
    std::size_t sure = static_cast<std::size_t>(made.index) + 1, timed = sure, soon = sure;
    for (const Place& h : holders) {
      if (!h.exists()) continue;
      const std::size_t end = order.first_after(made.worker, h.worker, h.index);
      sure = std::max(sure, end);
      soon = std::max(soon, order.known_before(made.worker, h.worker, h.index));
      if (!clock) continue;
      const std::size_t on_clock =
          h.worker == made.worker ? end
                                  : clock->first_from(made.worker, clock->end(h.worker, h.index));
      timed = std::max(timed, std::min(end, on_clock));
    }
    const auto w = static_cast<std::size_t>(made.worker);
    out.after[w][static_cast<std::size_t>(made.index)] += n;
    out.before[w][sure] += n;
    out.soonest[w][soon] += n;
    if (clock) out.expected[w][timed] += n;
  };
  for (int j = 0; j + 1 < plan.stages; ++j) {
    const CellBytes& here = bytes(j);
    const CellBytes& next = bytes(j + 1);
    for (int i = 0; i < plan.micro_batches; ++i) {
      const std::size_t c = places.cell(j, i), d = places.cell(j + 1, i);
      // The output: this cell keeps it until its backward unless checkpointed; the next cell
      // until its offload, its B, or its I (its W when W reads its inputs).
      const Place own = places.recompute[c].exists() ? Place{} : places.first_backward(j, i);
      Place theirs = places.offload[d];
      if (!theirs.exists()) theirs = places.backward[d];
      if (!theirs.exists())
        theirs = next.weight_reads_input ? places.weight_grad[d] : places.input_grad[d];
      hold(here.output, places.forward[c], {own, theirs});
      // The gradient the next cell sends back: this cell holds it until its B, or its I (its W
      // when W starts from it).
      Place used = places.backward[c];
      if (!used.exists())
        used = here.weight_reads_grad ? places.weight_grad[c] : places.input_grad[c];
      hold(next.sent_grad, places.first_backward(j + 1, i), {used});
    }
  }
  return out;
}

}  // namespace stagewise::schedule::detail
