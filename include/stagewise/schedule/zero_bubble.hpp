#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <algorithm>
#include <string_view>

namespace stagewise::schedule {

/// Zero-bubble ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with every backward split into its
/// input-gradient part I, which the previous stage waits for, and its weight-gradient part W,
/// which nobody waits for. Stage s holds back its W passes by s micro-batches and runs them in the
/// cool-down, where 1F1B idles. With costs T_F, T_B (input part) and T_W the idle time per stage
/// is (K-1)(T_F + T_B - T_W) instead of 1F1B's (K-1)(T_F + T_B + T_W), about a third when the
/// three are equal (needs M >= K), and no stage holds more than K micro-batches, 1F1B's peak.
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::zero_bubble_h1{});
struct zero_bubble_h1 {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "zero_bubble_h1";
  /// The name its paper gives it.
  static constexpr std::string_view title = "ZB-H1";
  /// Stages per worker: 1.
  static constexpr int stages_per_worker() { return 1; }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    for (int s = 0; s < stages; ++s) {
      const int warmup = std::min(stages - 1 - s, micro_batches);
      int forwards = 0;
      int weights = 0;
      for (; forwards < warmup; ++forwards) co_yield Action{s, ActionKind::forward, forwards};
      for (int i = 0; i < micro_batches; ++i) {
        if (forwards < micro_batches) co_yield Action{s, ActionKind::forward, forwards++};
        co_yield Action{s, ActionKind::input_grad, i};
        // W of micro-batch i - s: the later stages' I passes are not held up by this one's W.
        if (i - weights >= s) co_yield Action{s, ActionKind::weight_grad, weights++};
      }
      for (; weights < micro_batches; ++weights)
        co_yield Action{s, ActionKind::weight_grad, weights};
    }
  }
};

}  // namespace stagewise::schedule
