#pragma once

// What one worker of a plan can know of another's progress, for schedule::worker_memory: the
// first action of worker a that starts after a given action of worker b has ended, as the
// pipeline's messages order them (program order on each worker; an activation from an F to the
// next stage's F; a gradient from a B or I to the previous stage's B or I). A tensor worker a
// made and a cell of worker b lets go is freed, for worker a's memory, no later than that.

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/detail/replay.hpp"
#include "stagewise/schedule/plan.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace stagewise::schedule::detail {

// Where a cell's actions are: the worker and the index in its program of each kind (-1: none).
struct CellPlaces {
  struct Place {
    int worker = -1;
    int index = -1;
    bool exists() const { return index >= 0; }
  };
  int micro_batches = 0;
  std::vector<Place> forward, recompute, backward, input_grad, weight_grad, offload, reload;

  explicit CellPlaces(const Plan& plan) : micro_batches(plan.micro_batches) {
    const auto cells =
        static_cast<std::size_t>(plan.stages) * static_cast<std::size_t>(plan.micro_batches);
    for (auto* v : {&forward, &recompute, &backward, &input_grad, &weight_grad, &offload, &reload})
      v->assign(cells, Place{});
    for (std::size_t w = 0; w < plan.programs.size(); ++w) {
      const auto& program = plan.programs[w];
      for (std::size_t k = 0; k < program.size(); ++k) {
        const Action& a = program[k];
        slot(*this, a.kind)[cell(a.stage, a.micro)] = {static_cast<int>(w), static_cast<int>(k)};
      }
    }
  }
  std::size_t cell(int stage, int micro) const {
    return static_cast<std::size_t>(stage) * static_cast<std::size_t>(micro_batches) +
           static_cast<std::size_t>(micro);
  }
  // The cell's B, or its I when the schedule splits its backward.
  Place first_backward(int stage, int micro) const {
    const Place b = backward[cell(stage, micro)];
    return b.exists() ? b : input_grad[cell(stage, micro)];
  }
  const std::vector<Place>& of(ActionKind kind) const { return slot(*this, kind); }

 private:
  template <class Self>
  static auto slot(Self& self, ActionKind kind) -> decltype((self.forward)) {
    switch (kind) {
      case ActionKind::forward:
        return self.forward;
      case ActionKind::recompute:
        return self.recompute;
      case ActionKind::backward:
        return self.backward;
      case ActionKind::input_grad:
        return self.input_grad;
      case ActionKind::weight_grad:
        return self.weight_grad;
      case ActionKind::offload:
        return self.offload;
      case ActionKind::reload:
        return self.reload;
    }
    return self.forward;
  }
};

// Vector clocks over a plan: for each action, how many actions of every worker ended before it
// starts. Built once per plan (its actions times its workers), then asked `first_after` and
// `known_before`.
class CausalOrder {
 public:
  CausalOrder(const Plan& plan, const CellPlaces& places)
      : workers_(static_cast<std::size_t>(plan.workers)) {
    offsets_.push_back(0);
    for (const auto& program : plan.programs) offsets_.push_back(offsets_.back() + program.size());
    known_.assign(offsets_.back() * workers_, 0);
    // Any order replay places actions in respects what each waits for.
    Dependencies deps(plan.stages, plan.micro_batches);
    const auto order = replay(plan.programs, deps, [](const Action&) { return 1.0; });
    std::vector<std::size_t> next(workers_, 0);
    for (const auto& t : order.timed) {
      const auto w = static_cast<std::size_t>(t.worker);
      const std::size_t k = next[w]++;
      std::int32_t* mine = row(w, k);
      if (k > 0) std::copy_n(row(w, k - 1), workers_, mine);
      mine[w] = static_cast<std::int32_t>(k);
      for (const auto& from : sources(t.action, places)) {
        if (!from.exists()) continue;
        const std::int32_t* theirs =
            row(static_cast<std::size_t>(from.worker), static_cast<std::size_t>(from.index));
        for (std::size_t v = 0; v < workers_; ++v) mine[v] = std::max(mine[v], theirs[v]);
        // Their action itself has ended too.
        auto& seen = mine[static_cast<std::size_t>(from.worker)];
        seen = std::max(seen, from.index + 1);
      }
    }
  }

  // The first index of worker a's program whose action starts after the end of action r of
  // worker b (programs[a].size(): none does, within the step).
  // How many of worker a's actions end before action r of worker b starts, by the plan's
  // messages: those run while anything r lets go is still held, whatever the speeds.
  std::size_t known_before(int a, int b, int r) const {
    if (a == b) return static_cast<std::size_t>(r) + 1;
    return static_cast<std::size_t>(
        row(static_cast<std::size_t>(b), static_cast<std::size_t>(r))[static_cast<std::size_t>(a)]);
  }

  std::size_t first_after(int a, int b, int r) const {
    const auto wa = static_cast<std::size_t>(a);
    const std::size_t size = offsets_[wa + 1] - offsets_[wa];
    if (a == b) return static_cast<std::size_t>(r) + 1;
    // A worker's knowledge only grows along its program: the first index that knows of r.
    std::size_t lo = 0, hi = size;
    while (lo < hi) {
      const std::size_t mid = (lo + hi) / 2;
      if (row(wa, mid)[static_cast<std::size_t>(b)] > r) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  }

 private:
  // What action `a` receives from other cells: an F the previous stage's activation, a B or I
  // the next stage's gradient (from its B or I).
  static std::vector<CellPlaces::Place> sources(const Action& a, const CellPlaces& places) {
    const auto stages =
        static_cast<int>(places.forward.size() / static_cast<std::size_t>(places.micro_batches));
    if (a.kind == ActionKind::forward && a.stage > 0) {
      return {places.forward[places.cell(a.stage - 1, a.micro)]};
    }
    if ((a.kind == ActionKind::backward || a.kind == ActionKind::input_grad) &&
        a.stage + 1 < stages) {
      return {places.first_backward(a.stage + 1, a.micro)};
    }
    return {};
  }
  std::int32_t* row(std::size_t w, std::size_t k) { return &known_[(offsets_[w] + k) * workers_]; }
  const std::int32_t* row(std::size_t w, std::size_t k) const {
    return &known_[(offsets_[w] + k) * workers_];
  }

  std::size_t workers_;
  std::vector<std::size_t> offsets_;
  std::vector<std::int32_t> known_;
};

}  // namespace stagewise::schedule::detail
