#include "stagewise/stage/block_partition.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// The smallest largest block over every split of `costs` into `parts` non-empty blocks.
double brute_force(const std::vector<double>& costs, int64_t parts) {
  const auto n = static_cast<int64_t>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> sizes;
  std::function<void(int64_t, int64_t)> go = [&](int64_t start, int64_t left) {
    if (left == 1) {
      sizes.push_back(n - start);
      best = std::min(best, sw::largest_block(costs, sizes));
      sizes.pop_back();
      return;
    }
    for (int64_t size = 1; start + size <= n - (left - 1); ++size) {
      sizes.push_back(size);
      go(start + size, left - 1);
      sizes.pop_back();
    }
  };
  go(0, parts);
  return best;
}

}  // namespace

TEST_SUITE("block partition") {
  TEST_CASE("1..6 into 2 blocks gives [1,2,3,4] and [5,6]") {
    const std::vector<double> costs{1, 2, 3, 4, 5, 6};
    CHECK(sw::block_partition(costs, 2) == std::vector<std::vector<double>>{{1, 2, 3, 4}, {5, 6}});
    CHECK(sw::block_sizes(costs, 2) == std::vector<int64_t>{4, 2});
    CHECK(sw::largest_block(costs, {4, 2}) == 11);
  }

  TEST_CASE("one block takes everything and n blocks take one cost each") {
    const std::vector<double> costs{3, 1, 2};
    CHECK(sw::block_sizes(costs, 1) == std::vector<int64_t>{3});
    CHECK(sw::block_sizes(costs, 3) == std::vector<int64_t>{1, 1, 1});
  }

  TEST_CASE("among equal optima the earlier blocks are the longer ones") {
    CHECK(sw::block_sizes({1, 1, 1, 1, 1}, 2) == std::vector<int64_t>{3, 2});
    CHECK(sw::block_sizes({0, 0, 0, 0}, 3) == std::vector<int64_t>{2, 1, 1});
    CHECK(sw::block_sizes({5, 0, 0, 5}, 2) == std::vector<int64_t>{3, 1});
  }

  TEST_CASE("the dynamic programme equals brute force on 1000 random instances") {
    std::mt19937 rng(12345);
    std::uniform_int_distribution<int> length(1, 10);
    std::uniform_int_distribution<int> cost(0, 100);
    int compared = 0;
    for (int instance = 0; instance < 1000; ++instance) {
      const int n = length(rng);
      std::vector<double> costs;
      // Integer costs: every sum is exact, so the optimum compares with ==.
      for (int i = 0; i < n; ++i) costs.push_back(cost(rng));
      const int64_t parts = std::uniform_int_distribution<int>(1, n)(rng);
      const auto sizes = sw::block_sizes(costs, parts);
      REQUIRE(static_cast<int64_t>(sizes.size()) == parts);
      int64_t total = 0;
      for (const int64_t s : sizes) {
        REQUIRE(s >= 1);
        total += s;
      }
      REQUIRE(total == n);
      REQUIRE(sw::largest_block(costs, sizes) == brute_force(costs, parts));
      ++compared;
    }
    CHECK(compared == 1000);
  }

  TEST_CASE("non-positive partitions, too short a sequence and bad costs are errors") {
    const std::vector<double> costs{1, 2, 3};
    const auto zero = error_of([&] { sw::block_sizes(costs, 0); });
    CHECK(contains(zero, "partitions must be at least 1, got 0"));
    CHECK(contains(error_of([&] { sw::block_sizes(costs, -2); }), "at least 1, got -2"));
    const auto short_seq = error_of([&] { sw::block_partition(costs, 4); });
    CHECK(contains(short_seq, "cannot split 3 costs into 4 non-empty blocks; use at most 3"));
    const auto negative = error_of([&] { sw::block_sizes({1, -1}, 1); });
    CHECK(contains(negative, "cost 1 is -1; costs must be finite and non-negative"));
    const auto nan = error_of([&] { sw::block_sizes({std::nan("")}, 1); });
    CHECK(contains(nan, "cost 0 is nan"));
  }
}
