#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/detail/v_shape.hpp"

#include <c10/util/Exception.h>

#include <deque>
#include <string_view>

namespace stagewise::schedule {

/// DualPipeV (DeepSeek-V3's DualPipe, arXiv 2412.19437, in its "V" form with one model copy,
/// as torch.distributed.pipelining's ScheduleDualPipeV): 2K stages in a V on K workers (worker w
/// runs stages w and 2K-1-w, like ZB-V), with a steady state of overlapped pairs: each worker
/// alternates "forward of one stage + full backward of the other", the pairs that DualPipe runs
/// together to hide communication; stagewise runs a pair's two actions back to back. Around it,
/// some backwards are split into I and a deferred W (first-in first-out) to fill the warm-up and
/// the drain. Needs M >= 2K micro-batches.
///   pipe8->train_step(x, y, loss_fn, stagewise::schedule::dualpipe_v{});  // 8 stages, 4 workers
struct dualpipe_v {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "dualpipe_v";
  /// The name its paper gives it.
  static constexpr std::string_view title = "DualPipeV";
  /// Stages per worker: 2.
  static constexpr int stages_per_worker() { return 2; }
  /// The fewest micro-batches it runs on `workers` workers: 2 x workers.
  static constexpr int min_micro_batches(int workers) { return 2 * workers; }

  /// Number of workers for `stages` stages: stages / 2.
  int workers(int stages) const { return detail::v_workers(stages, name, title); }
  /// Worker w runs stages w and 2K-1-w.
  int worker_of(int stage, int stages) const { return detail::v_worker_of(stage, workers(stages)); }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int k = workers(stages);
    const int m = micro_batches;
    TORCH_CHECK(m >= min_micro_batches(k), "stagewise::schedule::dualpipe_v: ", m,
                " micro-batches for ", k,
                " workers; DualPipeV needs at least 2 x workers = ", min_micro_batches(k),
                " micro-batches (PipeOptions().chunks(", min_micro_batches(k),
                ") or more), or use zero_bubble_v, which takes any number");
    for (int r = 0; r < k; ++r) {
      const int stage[2] = {r, 2 * k - 1 - r};
      int f[2] = {0, 0};
      int b[2] = {0, 0};
      std::deque<Action> weights;  // W passes owed by split backwards, oldest first
      auto forward = [&](int c) { return Action{stage[c], ActionKind::forward, f[c]++}; };
      auto backward = [&](int c, bool split) {
        if (!split) return Action{stage[c], ActionKind::backward, b[c]++};
        weights.push_back({stage[c], ActionKind::weight_grad, b[c]});
        return Action{stage[c], ActionKind::input_grad, b[c]++};
      };
      auto weight = [&] {
        const Action a = weights.front();
        weights.pop_front();
        return a;
      };
      const int later = k - r - 1;  // workers after this one on the way down
      // 1. Forwards of the way down while the later workers fill.
      for (int n = 0; n < 2 * later; ++n) co_yield forward(0);
      // 2. One forward of each stage, alternating.
      for (int n = 0; n < r + 1; ++n) {
        co_yield forward(0);
        co_yield forward(1);
      }
      // 3. The way up's first backwards, split, their W right away, then its next forward.
      for (int n = 0; n < later; ++n) {
        co_yield backward(1, true);
        co_yield weight();
        co_yield forward(1);
      }
      // 4. Steady state: pairs (F down + B up), (F up + B down).
      for (int n = 0; n < m - 2 * k + r + 1; ++n) {
        co_yield forward(0);
        co_yield backward(1, false);
        co_yield forward(1);
        co_yield backward(0, false);
      }
      // 5. The way down has no forwards left: B up, then the pair (F up + B down).
      for (int n = 0; n < later; ++n) {
        co_yield backward(1, false);
        co_yield forward(1);
        co_yield backward(0, false);
      }
      // 6. Backwards of both stages; from the middle on, split, leaving W for the gaps below.
      bool split = false;
      for (int n = 0; n < r + 1; ++n) {
        if (n == (r + 1) / 2 && r % 2 == 1) split = true;
        co_yield backward(1, split);
        if (n == (r + 1) / 2 && r % 2 == 0) split = true;
        co_yield backward(0, split);
      }
      // 7. A deferred W, then the next backward of the way down (split).
      for (int n = 0; n < later; ++n) {
        co_yield weight();
        co_yield backward(0, true);
      }
      // 8. The remaining W passes.
      while (!weights.empty()) co_yield weight();
    }
  }
};

}  // namespace stagewise::schedule
