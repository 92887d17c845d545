#pragma once

// The V schedules that hold a bounded number of activations per worker (v_half, v_min): 2K stages
// in a V on K workers (v_shape.hpp), split backwards (I then W), and a cap on the cells each
// worker holds at once, counted as the simulator counts them (+1 at a cell's F, -1 at its W).

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/detail/v_shape.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <optional>
#include <vector>

namespace stagewise::schedule::detail {

// The state of capped_v_programs' list scheduling: when each cell's F and I end, each stage's
// next F, I and W, and the cells each worker holds.
class CappedVClock {
 public:
  CappedVClock(int k, int m, int cap)
      : k_(k),
        m_(m),
        cap_(cap),
        f_end_(static_cast<std::size_t>(2 * k * m), kNever),
        i_end_(static_cast<std::size_t>(2 * k * m), kNever),
        next_f_(static_cast<std::size_t>(2 * k), 0),
        next_i_(static_cast<std::size_t>(2 * k), 0),
        next_w_(static_cast<std::size_t>(2 * k), 0),
        cells_(static_cast<std::size_t>(k), 0) {}

  // What worker `w` runs at tick `t`: an I whose inputs exist (the oldest micro-batch first; on
  // a tie, the way up, nearer the loss), else an F the cap allows, else a W; nothing if none.
  std::optional<Action> pick(int w, long t) const {
    const int pair[2] = {2 * k_ - 1 - w, w};  // the way up first: it is nearer the loss
    std::optional<Action> best;
    auto consider = [&](Action a) {
      if (!best || a.micro < best->micro) best = a;
    };
    for (int s : pair) {
      const int i = next(next_i_, s);
      if (i < m_ && done_by(f_end_[at(s, i)], t) &&
          (s == 2 * k_ - 1 || done_by(i_end_[at(s + 1, i)], t))) {
        consider({s, ActionKind::input_grad, i});
      }
    }
    if (best) return best;
    for (int s : pair) {
      const int i = next(next_f_, s);
      if (i >= m_ || (s > 0 && !done_by(f_end_[at(s - 1, i)], t))) continue;
      const int room = s == w ? 2 : 1;  // way down: its own cell and one left free
      if (cells_[static_cast<std::size_t>(w)] + room > cap_) continue;
      consider({s, ActionKind::forward, i});
    }
    if (best) return best;
    for (int s : pair) {
      const int i = next(next_w_, s);
      if (i < next(next_i_, s) && done_by(i_end_[at(s, i)], t)) {
        consider({s, ActionKind::weight_grad, i});
      }
    }
    return best;
  }

  // Runs `a` from tick t to t + 1.
  void apply(const Action& a, long t) {
    const auto s = static_cast<std::size_t>(a.stage);
    auto& worker_cells = cells_[static_cast<std::size_t>(v_worker_of(a.stage, k_))];
    switch (a.kind) {
      case ActionKind::forward:
        f_end_[at(a.stage, a.micro)] = t + 1;
        ++next_f_[s];
        ++worker_cells;
        break;
      case ActionKind::input_grad:
        i_end_[at(a.stage, a.micro)] = t + 1;
        ++next_i_[s];
        break;
      default:
        ++next_w_[s];
        --worker_cells;
        break;
    }
  }

 private:
  static constexpr long kNever = -1;
  static bool done_by(long end, long t) { return end != kNever && end <= t; }
  static int next(const std::vector<int>& per_stage, int s) {
    return per_stage[static_cast<std::size_t>(s)];
  }
  std::size_t at(int stage, int micro) const {
    return static_cast<std::size_t>(stage) * static_cast<std::size_t>(m_) +
           static_cast<std::size_t>(micro);
  }

  int k_;
  int m_;
  int cap_;
  std::vector<long> f_end_;
  std::vector<long> i_end_;
  std::vector<int> next_f_;
  std::vector<int> next_i_;
  std::vector<int> next_w_;
  std::vector<int> cells_;
};

/// Each worker's actions for 2K stages in a V on `k` workers and `m` micro-batches, with at most
/// `cap` cells alive on any worker. The order comes from list scheduling on a unit clock
/// (T_F = T_B = T_W): whenever a worker is free it runs, of the actions whose inputs exist, an I
/// (the oldest micro-batch first, the later stage first), else an F the cap allows (the same
/// order), else a W. Each stage takes its micro-batches in order.
///
/// The cap cannot deadlock: an F on a worker's way-down stage (a new micro-batch for it) also
/// leaves one cell free, so the way-up F of the oldest micro-batch always finds room; that
/// micro-batch then reaches the loss, its I passes run and its W passes free its cells.
/// `cap` >= 2 (one micro-batch's two cells).
inline std::vector<std::vector<Action>> capped_v_programs(int k, int m, int cap) {
  TORCH_CHECK(cap >= 2, "stagewise::schedule: a V schedule needs room for 2 cells per worker, the "
              "cap is ", cap);
  CappedVClock clock(k, m, cap);
  std::vector<std::vector<Action>> programs(static_cast<std::size_t>(k));
  const long total = 3L * 2 * k * m;
  long done = 0;
  // Every worker is free at each tick of the unit clock (all costs are 1).
  for (long t = 0; done < total; ++t) {
    TORCH_CHECK(t <= 4 * total + 4, "stagewise::schedule: internal error: the capped V schedule "
                "for ", k, " workers, ", m, " micro-batches and cap ", cap, " made no progress");
    // Decide every worker's action at t from the state at t, then apply them.
    std::vector<Action> chosen;
    for (int w = 0; w < k; ++w) {
      if (auto a = clock.pick(w, t)) {
        programs[static_cast<std::size_t>(w)].push_back(*a);
        chosen.push_back(*a);
      }
    }
    for (const auto& a : chosen) clock.apply(a, t);
    done += static_cast<long>(chosen.size());
  }
  return programs;
}

/// A V schedule whose workers each hold at most `Derived::cells(K)` cells: `workers`, `worker_of`
/// and the actions, for v_half and v_min. `Derived` names itself in errors (`name`, `title`).
template <class Derived>
struct capped_v {
  /// Number of workers for `stages` stages: stages / 2.
  int workers(int stages) const { return v_workers(stages, Derived::name, Derived::title); }
  /// Worker w runs stages w and 2K-1-w.
  int worker_of(int stage, int stages) const { return v_worker_of(stage, workers(stages)); }
  /// Stages per worker: 2.
  static constexpr int stages_per_worker() { return 2; }
  /// The most cells (micro-batch, stage) a worker holds at once for `stages` stages: the cap the
  /// schedule is built under, reached once there are enough micro-batches (M >= K).
  int peak_cells(int stages) const { return Derived::cells(workers(stages)); }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int k = workers(stages);
    TORCH_CHECK(micro_batches >= 1, "stagewise::schedule::", Derived::name, ": ", micro_batches,
                " micro-batches; give 1 or more");
    for (auto& program : capped_v_programs(k, micro_batches, Derived::cells(k))) {
      for (const auto& a : program) co_yield a;
    }
  }
};

}  // namespace stagewise::schedule::detail
