#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <algorithm>
#include <string_view>

namespace stagewise::schedule {

/// One-forward-one-backward (PipeDream-Flush): stage s runs `stages - 1 - s` warm-up forwards,
/// then alternates one forward and one backward, then drains the remaining backwards. Same bubble
/// as GPipe, (K-1)/(M+K-1), but stage s holds at most K - s micro-batches of activations instead
/// of M. Backwards run in micro-batch order 0 .. M-1 on every stage.
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::one_f_one_b{});
struct one_f_one_b {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "one_f_one_b";
  /// The name its paper gives it.
  static constexpr std::string_view title = "1F1B";
  /// Stages per worker: 1.
  static constexpr int stages_per_worker() { return 1; }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    for (int s = 0; s < stages; ++s) {
      const int warmup = std::min(stages - 1 - s, micro_batches);
      for (int i = 0; i < warmup; ++i) co_yield Action{s, ActionKind::forward, i};
      for (int i = warmup; i < micro_batches; ++i) {
        co_yield Action{s, ActionKind::forward, i};
        co_yield Action{s, ActionKind::backward, i - warmup};
      }
      for (int i = micro_batches - warmup; i < micro_batches; ++i) {
        co_yield Action{s, ActionKind::backward, i};
      }
    }
  }
};

}  // namespace stagewise::schedule
