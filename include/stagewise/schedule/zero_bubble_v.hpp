#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/detail/v_shape.hpp"

#include <c10/util/Exception.h>

#include <string_view>

namespace stagewise::schedule {

/// ZB-V (Qi et al., arXiv 2401.10241, section 6): the model is cut into 2K stages placed in a V
/// on K workers, worker w running stages w (on the way down) and 2K-1-w (on the way up), so the
/// last stage, with the loss, sits on worker 0 beside the first. Backwards are split into I and
/// W as in ZB-H1; each worker warms up with forwards of its first stage, then its second, then
/// settles into F, I, W of each stage in turn and drains I passes before W passes. With
/// T_F = T_B = T_W the pipeline has no bubble once M >= 2K (only the fill and drain of one
/// stage-half remain: idle per worker (K-1)(T_F+T_B-2T_W) in whole-stage units, the paper's
/// formula), and no worker holds more than 2K half-stage cells, 1F1B's K whole micro-batches.
///   auto pipe8 = sw::Pipe(seq, sw::even_balance(seq->size(), 8), sw::PipeOptions().chunks(8));
///   pipe8->train_step(x, y, loss_fn, stagewise::schedule::zero_bubble_v{});  // on 4 workers
struct zero_bubble_v {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "zero_bubble_v";
  /// The name its paper gives it.
  static constexpr std::string_view title = "ZB-V";
  /// Stages per worker: 2.
  static constexpr int stages_per_worker() { return 2; }

  /// Number of workers for `stages` stages: stages / 2.
  int workers(int stages) const { return detail::v_workers(stages, name, title); }
  /// Worker w runs stages w and 2K-1-w.
  int worker_of(int stage, int stages) const { return detail::v_worker_of(stage, workers(stages)); }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    const int k = workers(stages);
    const int m = micro_batches;
    for (int w = 0; w < k; ++w) {
      const int down = w;
      const int up = 2 * k - 1 - w;
      int f0 = 0, f1 = 0, i0 = 0, i1 = 0, w0 = 0, w1 = 0;
      // Each step yields an action only when it is the stage's next due one: a cell's I after
      // its F (and, on the way down, after the way up's I of the same micro-batch, whose
      // gradient it needs), a W after its I.
      auto forward_down = [&]() -> bool { return f0 < m; };
      auto forward_up = [&]() -> bool { return f1 < m && f1 < f0; };
      auto input_up = [&]() -> bool { return i1 < f1; };
      auto input_down = [&]() -> bool { return i0 < f0 && i0 < i1; };
      // Warm-up: enough forwards of the way down that the way up's first micro-batch comes back
      // here as the forwards of the later workers finish.
      for (int n = 0; n < 2 * (k - w) - 1; ++n) {
        if (forward_down()) co_yield Action{down, ActionKind::forward, f0++};
      }
      for (int n = 0; n < w; ++n) {
        if (forward_up()) co_yield Action{up, ActionKind::forward, f1++};
        if (forward_down()) co_yield Action{down, ActionKind::forward, f0++};
      }
      for (int n = 0; n < k - w; ++n) {
        if (forward_up()) co_yield Action{up, ActionKind::forward, f1++};
        if (input_up()) {
          co_yield Action{up, ActionKind::input_grad, i1++};
          co_yield Action{up, ActionKind::weight_grad, w1++};
        }
      }
      // Steady state: F, I, W of the way down, then of the way up.
      while (f1 < m) {
        if (forward_down()) co_yield Action{down, ActionKind::forward, f0++};
        if (input_down()) {
          co_yield Action{down, ActionKind::input_grad, i0++};
          co_yield Action{down, ActionKind::weight_grad, w0++};
        }
        if (forward_up()) co_yield Action{up, ActionKind::forward, f1++};
        if (input_up()) {
          co_yield Action{up, ActionKind::input_grad, i1++};
          co_yield Action{up, ActionKind::weight_grad, w1++};
        }
      }
      // Drain: the I passes first (the other workers wait for them), a W after each I of the way
      // down once the way up is done, the remaining W passes at the end.
      while (i1 < m) {
        if (input_down()) co_yield Action{down, ActionKind::input_grad, i0++};
        co_yield Action{up, ActionKind::input_grad, i1++};
      }
      while (i0 < m) {
        co_yield Action{down, ActionKind::input_grad, i0++};
        co_yield Action{down, ActionKind::weight_grad, w0++};
      }
      while (w1 < m) co_yield Action{up, ActionKind::weight_grad, w1++};
      while (w0 < m) co_yield Action{down, ActionKind::weight_grad, w0++};
    }
  }
};

}  // namespace stagewise::schedule
