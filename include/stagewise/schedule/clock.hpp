#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"

#include <algorithm>
#include <vector>

namespace stagewise::schedule {

/// GPipe's clock cycles for `m` micro-batches and `n` stages: cycle k holds the cells
/// (k - j, j) for j = max(0, k - m + 1) .. min(k, n - 1), so micro-batch i reaches stage j at
/// cycle i + j. The forward executor runs each cycle's cells concurrently, cycle after cycle.
///   m = 3, n = 3: [(0,0)] [(1,0),(0,1)] [(2,0),(1,1),(0,2)] [(2,1),(1,2)] [(2,2)]
inline coro::generator<std::vector<Cell>> clock_cycles(int m, int n) {
  for (int k = 0; k < m + n - 1; ++k) {
    std::vector<Cell> cycle;
    for (int j = std::max(0, k - m + 1); j <= std::min(k, n - 1); ++j) cycle.push_back({k - j, j});
    co_yield cycle;
  }
}

}  // namespace stagewise::schedule
