#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/clock.hpp"

namespace stagewise::schedule {

/// GPipe's fill-drain schedule: every stage runs the forwards of all micro-batches, then their
/// backwards in reverse order. Yields actions in clock order (forward cycles, then backward
/// cycles mirrored), which is also the order each stage performs them.
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::gpipe{});
struct gpipe {
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
