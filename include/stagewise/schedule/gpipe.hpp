#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/clock.hpp"

#include <string_view>

namespace stagewise::schedule {

/// GPipe's fill-drain schedule: every stage runs the forwards of all micro-batches, then their
/// backwards in reverse order. Yields actions in clock order (forward cycles, then backward
/// cycles mirrored), which is also the order each stage performs them.
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::gpipe{});
struct gpipe {
  /// Its name (`named_schedule`): in `choose`'s report, `any_schedule(s)`, tools.
  static constexpr std::string_view name = "gpipe";
  /// The name its paper gives it.
  static constexpr std::string_view title = "GPipe";
  /// Stages per worker: 1.
  static constexpr int stages_per_worker() { return 1; }

  coro::generator<Action> operator()(int stages, int micro_batches) const {
    for (const auto& cycle : clock_cycles(micro_batches, stages)) {
      for (const auto& c : cycle) co_yield Action{c.stage, ActionKind::forward, c.micro};
    }
    // Backward runs the grid mirrored: the last stage's last micro-batch first.
    for (const auto& cycle : clock_cycles(micro_batches, stages)) {
      for (const auto& c : cycle) {
        co_yield Action{stages - 1 - c.stage, ActionKind::backward, micro_batches - 1 - c.micro};
      }
    }
  }
};

}  // namespace stagewise::schedule
