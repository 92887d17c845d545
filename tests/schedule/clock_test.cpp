#include "stagewise/schedule/clock.hpp"
#include "stagewise/schedule/gpipe.hpp"

#include <doctest/doctest.h>

#include <vector>

namespace sched = stagewise::schedule;
using Cells = std::vector<std::vector<sched::Cell>>;

namespace {
Cells cycles(int m, int n) {
  Cells out;
  for (const auto& c : sched::clock_cycles(m, n)) out.push_back(c);
  return out;
}
}  // namespace

TEST_SUITE("clock cycles") {
  TEST_CASE("one micro-batch on one stage is one cycle") { CHECK(cycles(1, 1) == Cells{{{0, 0}}}); }

  TEST_CASE("one micro-batch on three stages walks down the stages") {
    CHECK(cycles(1, 3) == Cells{{{0, 0}}, {{0, 1}}, {{0, 2}}});
  }

  TEST_CASE("three micro-batches on one stage follow each other") {
    CHECK(cycles(3, 1) == Cells{{{0, 0}}, {{1, 0}}, {{2, 0}}});
  }

  TEST_CASE("three micro-batches on three stages fill and drain the diagonal") {
    CHECK(cycles(3, 3) == Cells{{{0, 0}},
                                {{1, 0}, {0, 1}},
                                {{2, 0}, {1, 1}, {0, 2}},
                                {{2, 1}, {1, 2}},
                                {{2, 2}}});
  }

  TEST_CASE("four micro-batches on two stages") {
    CHECK(cycles(4, 2) == Cells{{{0, 0}}, {{1, 0}, {0, 1}}, {{2, 0}, {1, 1}}, {{3, 0}, {2, 1}}, {{3, 1}}});
  }
}

TEST_SUITE("gpipe schedule") {
  TEST_CASE("each stage runs every forward, then every backward in reverse order") {
    std::vector<std::vector<sched::Action>> per_stage(2);
    for (const auto& a : sched::gpipe{}(2, 3)) per_stage[a.stage].push_back(a);
    using K = sched::ActionKind;
    CHECK(per_stage[0] == std::vector<sched::Action>{{0, K::forward, 0}, {0, K::forward, 1},
                                                     {0, K::forward, 2}, {0, K::backward, 2},
                                                     {0, K::backward, 1}, {0, K::backward, 0}});
    CHECK(per_stage[1] == std::vector<sched::Action>{{1, K::forward, 0}, {1, K::forward, 1},
                                                     {1, K::forward, 2}, {1, K::backward, 2},
                                                     {1, K::backward, 1}, {1, K::backward, 0}});
  }

  TEST_CASE("actions print as kind, micro-batch and stage") {
    CHECK(sched::to_string({1, sched::ActionKind::backward, 3}) == "B3@1");
  }
}
