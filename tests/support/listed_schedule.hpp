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

}  // namespace stagewise::testing
