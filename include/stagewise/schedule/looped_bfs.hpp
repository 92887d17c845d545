#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string_view>

namespace stagewise::schedule {

/// Looped breadth-first (BFS) pipelining (Lamy-Poirier, arXiv 2211.05953): like interleaved
/// 1F1B, v x K stages on K workers, worker w running stages w, w + K, ..., w + (v-1)K; but each
/// worker runs all M forwards of its first stage, then all of its second, ..., then the
/// backwards of its last stage first, micro-batches in reverse order (GPipe's order, looped).
/// For M >= K the idle time per worker is (K-1)(T_F+T_B+T_W)/v, interleaving's, with GPipe's
/// memory: every stage holds all M micro-batches until its backward.
///   pipe8->train_step(x, y, loss_fn, stagewise::schedule::looped_bfs{2});  // 8 stages, 4 workers
struct looped_bfs {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "looped_bfs";
  /// The name its paper gives it.
  static constexpr std::string_view title = "looped BFS";
  /// Not among `choose`'s default candidates: interleaved 1F1B has its idle time with less
  /// memory.
  static constexpr bool default_candidate = false;
  /// Stages per worker (v >= 1; v = 1 is GPipe).
  int virtual_stages = 2;
  /// Stages per worker: `virtual_stages`.
  int stages_per_worker() const { return virtual_stages; }

  /// Number of workers for `stages` stages: stages / v.
  int workers(int stages) const {
    TORCH_CHECK(virtual_stages >= 1, "stagewise::schedule::looped_bfs: virtual_stages ",
                "must be at least 1, got ", virtual_stages, "; use 1 for GPipe");
    TORCH_CHECK(stages % virtual_stages == 0, "stagewise::schedule::looped_bfs: ", stages,
                " stages do not split into ", virtual_stages,
                " virtual stages per worker; give the pipe a multiple of ", virtual_stages,
                " stages (e.g. a balance with ",
                virtual_stages * std::max(1, stages / virtual_stages),
                " entries), or change virtual_stages");
    return stages / virtual_stages;
  }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int k = workers(stages);
    for (int w = 0; w < k; ++w) {
      for (int c = 0; c < virtual_stages; ++c) {
        for (int i = 0; i < micro_batches; ++i) co_yield Action{c * k + w, ActionKind::forward, i};
      }
      for (int c = virtual_stages - 1; c >= 0; --c) {
        for (int i = micro_batches - 1; i >= 0; --i) {
          co_yield Action{c * k + w, ActionKind::backward, i};
        }
      }
    }
  }
};

}  // namespace stagewise::schedule
