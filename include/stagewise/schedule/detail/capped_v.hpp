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
  const int stages = 2 * k;
  const auto at = [m](int stage, int micro) {
    return static_cast<std::size_t>(stage) * static_cast<std::size_t>(m) +
           static_cast<std::size_t>(micro);
  };
  constexpr long kNever = -1;
  std::vector<long> f_end(static_cast<std::size_t>(stages * m), kNever);
  std::vector<long> i_end(static_cast<std::size_t>(stages * m), kNever);
  std::vector<int> next_f(static_cast<std::size_t>(stages), 0);
  std::vector<int> next_i(static_cast<std::size_t>(stages), 0);
  std::vector<int> next_w(static_cast<std::size_t>(stages), 0);
  std::vector<int> cells(static_cast<std::size_t>(k), 0);
  std::vector<std::vector<Action>> programs(static_cast<std::size_t>(k));
  const long total = 3L * stages * m;
  long done = 0;
  auto done_by = [](long end, long t) { return end != kNever && end <= t; };
  // Every worker is free at each tick of the unit clock (all costs are 1).
  for (long t = 0; done < total; ++t) {
    TORCH_CHECK(t <= 4 * total + 4, "stagewise::schedule: internal error: the capped V schedule "
                "for ", k, " workers, ", m, " micro-batches and cap ", cap, " made no progress");
    // Decide every worker's action at t from the state at t, then apply them.
    std::vector<Action> chosen;
    for (int w = 0; w < k; ++w) {
      const int pair[2] = {2 * k - 1 - w, w};  // the way up first: it is nearer the loss
      const auto wi = static_cast<std::size_t>(w);
      auto pick = [&]() -> std::optional<Action> {
        // The oldest micro-batch first; on a tie (the two stages at the same micro-batch) the
        // way up.
        std::optional<Action> best;
        auto consider = [&](Action a) {
          if (!best || a.micro < best->micro) best = a;
        };
        for (int s : pair) {
          const int i = next_i[static_cast<std::size_t>(s)];
          if (i < m && done_by(f_end[at(s, i)], t) &&
              (s == stages - 1 || done_by(i_end[at(s + 1, i)], t))) {
            consider({s, ActionKind::input_grad, i});
          }
        }
        if (best) return best;
        for (int s : pair) {
          const int i = next_f[static_cast<std::size_t>(s)];
          if (i >= m || (s > 0 && !done_by(f_end[at(s - 1, i)], t))) continue;
          const int room = s == w ? 2 : 1;  // way down: its own cell and one left free
          if (cells[wi] + room > cap) continue;
          consider({s, ActionKind::forward, i});
        }
        if (best) return best;
        for (int s : pair) {
          const int i = next_w[static_cast<std::size_t>(s)];
          if (i < next_i[static_cast<std::size_t>(s)] && done_by(i_end[at(s, i)], t)) {
            consider({s, ActionKind::weight_grad, i});
          }
        }
        return best;
      };
      if (auto a = pick()) {
        programs[wi].push_back(*a);
        chosen.push_back(*a);
      }
    }
    for (const auto& a : chosen) {
      const auto s = static_cast<std::size_t>(a.stage);
      auto& worker_cells = cells[static_cast<std::size_t>(v_worker_of(a.stage, k))];
      switch (a.kind) {
        case ActionKind::forward:
          f_end[at(a.stage, a.micro)] = t + 1;
          ++next_f[s];
          ++worker_cells;
          break;
        case ActionKind::input_grad:
          i_end[at(a.stage, a.micro)] = t + 1;
          ++next_i[s];
          break;
        default:
          ++next_w[s];
          --worker_cells;
          break;
      }
      ++done;
    }
  }
  return programs;
}

/// A V schedule whose workers each hold at most `Derived::cells(K)` cells: `workers`, `worker_of`
/// and the actions, for v_half and v_min. `Derived` names itself in errors (`name`, `paper`).
template <class Derived>
struct capped_v {
  /// Number of workers for `stages` stages: stages / 2.
  int workers(int stages) const { return v_workers(stages, Derived::name, Derived::paper); }
  /// Worker w runs stages w and 2K-1-w.
  int worker_of(int stage, int stages) const { return v_worker_of(stage, workers(stages)); }
  /// The most cells (micro-batch, stage) a worker holds at once for `stages` stages: the cap the
  /// schedule is built under, reached once there are enough micro-batches (M >= K).
  int peak_cells(int stages) const { return Derived::cells(workers(stages)); }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int k = workers(stages);
    TORCH_CHECK(micro_batches >= 1, Derived::name, ": ", micro_batches,
                " micro-batches; give 1 or more");
    for (auto& program : capped_v_programs(k, micro_batches, Derived::cells(k))) {
      for (const auto& a : program) co_yield a;
    }
  }
};

}  // namespace stagewise::schedule::detail
