#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace stagewise {

/// The sizes of the contiguous split of `costs` into `partitions` non-empty blocks whose largest
/// block sum is the smallest possible (the optimum, found by dynamic programming in
/// O(partitions * n^2)). Among equally good splits it returns the one whose earlier blocks are
/// longest. Costs must be finite and non-negative.
///   stagewise::block_sizes({1, 2, 3, 4, 5, 6}, 2) == {4, 2}   // sums 10 and 11
inline std::vector<int64_t> block_sizes(const std::vector<double>& costs, int64_t partitions) {
  const auto n = static_cast<int64_t>(costs.size());
  TORCH_CHECK(partitions >= 1, "stagewise::block_partition: partitions must be at least 1, got ",
              partitions, "; ask for one block per pipeline stage");
  TORCH_CHECK(n >= partitions, "stagewise::block_partition: cannot split ", n, " costs into ",
              partitions, " non-empty blocks; use at most ", n,
              " partitions, or split the model into more layers");
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double c = costs[static_cast<std::size_t>(i)];
    TORCH_CHECK(std::isfinite(c) && c >= 0, "stagewise::block_partition: cost ", i, " is ", c,
                "; costs must be finite and non-negative (times in seconds, sizes in bytes)");
    prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + c;
  }
  const auto sum = [&](int64_t from, int64_t to) {  // costs[from, to)
    return prefix[static_cast<std::size_t>(to)] - prefix[static_cast<std::size_t>(from)];
  };
  const double inf = std::numeric_limits<double>::infinity();
  const auto width = static_cast<std::size_t>(n) + 1;
  // best[k * width + j]: the smallest largest block splitting the first j costs into k blocks;
  // cut[...]: where its last block starts.
  std::vector<double> best(static_cast<std::size_t>(partitions + 1) * width, inf);
  std::vector<int64_t> cut(best.size(), 0);
  best[0] = 0.0;
  for (int64_t k = 1; k <= partitions; ++k) {
    // j leaves room for the remaining partitions - k blocks.
    for (int64_t j = k; j <= n - (partitions - k); ++j) {
      double value = inf;
      int64_t where = k - 1;
      // The last block is [i, j). Scanning i downwards and keeping strict improvements only
      // picks the shortest last block among the optima, so earlier blocks come out longest.
      for (int64_t i = j - 1; i >= k - 1; --i) {
        const double candidate = std::max(
            best[static_cast<std::size_t>(k - 1) * width + static_cast<std::size_t>(i)], sum(i, j));
        if (candidate < value) {
          value = candidate;
          where = i;
        }
      }
      best[static_cast<std::size_t>(k) * width + static_cast<std::size_t>(j)] = value;
      cut[static_cast<std::size_t>(k) * width + static_cast<std::size_t>(j)] = where;
    }
  }
  std::vector<int64_t> sizes(static_cast<std::size_t>(partitions));
  int64_t end = n;
  for (int64_t k = partitions; k >= 1; --k) {
    const int64_t start = cut[static_cast<std::size_t>(k) * width + static_cast<std::size_t>(end)];
    sizes[static_cast<std::size_t>(k - 1)] = end - start;
    end = start;
  }
  return sizes;
}

/// The blocks themselves: `costs` split as `block_sizes(costs, partitions)` says (torchgpipe's
/// `blockpartition.solve`).
///   stagewise::block_partition({1, 2, 3, 4, 5, 6}, 2) == {{1, 2, 3, 4}, {5, 6}}
inline std::vector<std::vector<double>> block_partition(const std::vector<double>& costs,
                                                        int64_t partitions) {
  std::vector<std::vector<double>> blocks;
  auto it = costs.begin();
  for (const int64_t size : block_sizes(costs, partitions)) {
    blocks.emplace_back(it, it + size);
    it += size;
  }
  return blocks;
}

/// The largest block sum of splitting `costs` into blocks of `sizes` (what `block_sizes`
/// minimises); for reports and tests.
///   stagewise::largest_block({1, 2, 3, 4, 5, 6}, {4, 2}) == 11
inline double largest_block(const std::vector<double>& costs, const std::vector<int64_t>& sizes) {
  double largest = 0.0;
  std::size_t next = 0;
  for (const int64_t size : sizes) {
    double block = 0.0;
    for (int64_t l = 0; l < size && next < costs.size(); ++l) block += costs[next++];
    largest = std::max(largest, block);
  }
  return largest;
}

}  // namespace stagewise
