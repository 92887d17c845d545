#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string_view>
#include <utility>
#include <vector>

namespace stagewise::schedule {

/// Interleaved 1F1B (Narayanan et al., 2021): the model is split into v x K stages and worker w
/// runs the virtual stages w, w + K, ..., w + (v-1)K, so a micro-batch visits every worker v
/// times in smaller steps. Micro-batches go in groups of K: a group passes through a worker's
/// first virtual stage, then its second, ...; backwards mirror that. When M is a multiple of K
/// the idle time per worker is 1F1B's divided by v, paid for by v times as many messages and by
/// more activations in flight. Any M is valid; other M give a larger bubble.
///   auto pipe = sw::Pipe(seq, sw::even_balance(seq->size(), 8), ...);  // 8 stages
///   pipe->train_step(x, y, loss_fn, sw::schedule::interleaved_one_f_one_b{2});  // on 4 workers
struct interleaved_one_f_one_b {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "interleaved_one_f_one_b";
  /// The name its paper gives it.
  static constexpr std::string_view title = "interleaved 1F1B";
  /// Stages per worker (v >= 1; v = 1 is plain 1F1B).
  int virtual_stages = 2;
  /// Stages per worker: `virtual_stages`.
  int stages_per_worker() const { return virtual_stages; }

  /// Number of workers for `stages` stages: stages / v.
  int workers(int stages) const {
    TORCH_CHECK(virtual_stages >= 1,
                "stagewise::schedule::interleaved_one_f_one_b: virtual_stages ",
                "must be at least 1, got ", virtual_stages, "; use 1 for plain 1F1B");
    TORCH_CHECK(
        stages % virtual_stages == 0, "stagewise::schedule::interleaved_one_f_one_b: ", stages,
        " stages do not split into ", virtual_stages,
        " virtual stages per worker; give the pipe a multiple of ", virtual_stages,
        " stages (e.g. a balance with ", virtual_stages * std::max(1, stages / virtual_stages),
        " entries), or change virtual_stages");
    return stages / virtual_stages;
  }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int v = virtual_stages;
    const int k = workers(stages);
    // Every worker's forward order: (chunk, micro) pairs, groups of k micro-batches at a time.
    std::vector<std::pair<int, int>> order;
    for (int first = 0; first < micro_batches; first += k) {
      for (int c = 0; c < v; ++c) {
        for (int i = first; i < std::min(first + k, micro_batches); ++i) order.emplace_back(c, i);
      }
    }
    const int total = static_cast<int>(order.size());
    for (int w = 0; w < k; ++w) {
      auto forward = [&](int n) {
        return Action{order[n].first * k + w, ActionKind::forward, order[n].second};
      };
      auto backward = [&](int n) {  // the last chunk's backward first
        return Action{(v - 1 - order[n].first) * k + w, ActionKind::backward, order[n].second};
      };
      // Enough warm-up forwards that the first backward's gradient can have come back.
      const int warmup = std::min((k - 1 - w) + (v - 1) * k, total);
      int f = 0;
      int b = 0;
      for (; f < warmup; ++f) co_yield forward(f);
      for (; f < total; ++f, ++b) {
        co_yield forward(f);
        co_yield backward(b);
      }
      for (; b < total; ++b) co_yield backward(b);
    }
  }
};

}  // namespace stagewise::schedule
