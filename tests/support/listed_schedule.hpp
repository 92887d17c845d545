#pragma once

// Test helper: a schedule that yields a given list of actions, and what the verifier says of it.

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/verify.hpp"
#include "tests/support/errors.hpp"

#include <string>
#include <utility>
#include <vector>

namespace stagewise::testing {

/// A schedule yielding `actions` whatever the grid.
struct listed {
  std::vector<schedule::Action> actions;
  coro::generator<schedule::Action> operator()(int, int) const {
    for (const auto& a : actions) co_yield a;
  }
};

/// The verifier's message for `actions` on `n` stages and `m` micro-batches ("(no error)").
inline std::string schedule_problem(std::vector<schedule::Action> actions, int n = 1, int m = 2) {
  return error_of([&] { schedule::verify(listed{std::move(actions)}, n, m); });
}

/// Short names for actions in tests: F(micro, stage) is the forward of `micro` on `stage`, and so
/// on for B, I, W, R (recompute), O (offload) and L (reload).
namespace actions {
inline schedule::Action F(int micro, int stage) {
  return {stage, schedule::ActionKind::forward, micro};
}
inline schedule::Action B(int micro, int stage) {
  return {stage, schedule::ActionKind::backward, micro};
}
inline schedule::Action I(int micro, int stage) {
  return {stage, schedule::ActionKind::input_grad, micro};
}
inline schedule::Action W(int micro, int stage) {
  return {stage, schedule::ActionKind::weight_grad, micro};
}
inline schedule::Action R(int micro, int stage) {
  return {stage, schedule::ActionKind::recompute, micro};
}
inline schedule::Action O(int micro, int stage) {
  return {stage, schedule::ActionKind::offload, micro};
}
inline schedule::Action L(int micro, int stage) {
  return {stage, schedule::ActionKind::reload, micro};
}
}  // namespace actions

}  // namespace stagewise::testing
