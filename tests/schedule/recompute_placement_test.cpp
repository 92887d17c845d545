// A schedule may place recomputes itself; plan inserts them only where it did not.
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/verify.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include "tests/support/errors.hpp"
#include "tests/support/listed_schedule.hpp"

#include <doctest/doctest.h>

#include <vector>

namespace sched = stagewise::schedule;
using sched::Action;
using sched::ActionKind;
using stagewise::coro::generator;
using stagewise::testing::contains;
using stagewise::testing::error_of;

namespace {

using namespace stagewise::testing::actions;

using stagewise::testing::listed;

std::string problem(std::vector<Action> actions, int n = 1, int m = 2) {
  return stagewise::testing::schedule_problem(std::move(actions), n, m);
}

// 1F1B that recomputes micro-batch i on each stage early, right after the forward of
// micro-batch i + 1, where its backward has not run yet; plan places the others.
struct early_recompute {
  generator<Action> operator()(int stages, int micro_batches) const {
    std::vector<char> done(static_cast<std::size_t>(stages * micro_batches), 0);
    for (const auto& a : sched::one_f_one_b{}(stages, micro_batches)) {
      co_yield a;
      if (a.kind == ActionKind::backward)
        done[static_cast<std::size_t>(a.stage * micro_batches + a.micro)] = 1;
      if (a.kind == ActionKind::forward && a.micro > 0 &&
          !done[static_cast<std::size_t>(a.stage * micro_batches + a.micro - 1)]) {
        co_yield Action{a.stage, ActionKind::recompute, a.micro - 1};
      }
    }
  }
};

}  // namespace

TEST_SUITE("recompute placement") {
  TEST_CASE("a yielded R between its F and first backward passes; plan adds the missing ones") {
    CHECK(problem({F(0, 0), R(0, 0), B(0, 0), F(1, 0), B(1, 0)}) == "(no error)");
    CHECK(problem({F(0, 0), F(1, 0), R(0, 0), I(0, 0), R(1, 0), I(1, 0), W(0, 0), W(1, 0)}) ==
          "(no error)");
    // Micro-batch 0's R is the schedule's, early; micro-batch 1's is plan's, before its B.
    auto p = sched::plan(listed{{F(0, 0), R(0, 0), F(1, 0), B(0, 0), B(1, 0)}}, 1, 2, 2);
    CHECK(p.programs[0] ==
          std::vector<Action>{F(0, 0), R(0, 0), F(1, 0), B(0, 0), R(1, 0), B(1, 0)});
  }

  TEST_CASE("an R out of place is named: before its F, after its backward, twice") {
    CHECK(
        contains(problem({R(0, 0), F(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                 "stagewise::schedule::verify: R0@0 (action #0) comes before F0@0 on stage 0; "
                 "a recompute re-runs a forward, so yield it after F0@0 and before B0@0 or I0@0"));
    CHECK(contains(problem({F(0, 0), I(0, 0), R(0, 0), W(0, 0), F(1, 0), B(1, 0)}),
                   "R0@0 (action #2) follows I0@0; the first backward of a checkpointed cell uses "
                   "what its recompute rebuilds, so yield the R before it"));
    CHECK(contains(problem({F(0, 0), B(0, 0), R(0, 0), F(1, 0), B(1, 0)}),
                   "R0@0 (action #2) follows B0@0"));
    CHECK(contains(problem({F(0, 0), R(0, 0), R(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                   "R0@0 (action #2) repeats the recompute of micro-batch 0 on stage 0; give each "
                   "checkpointed cell at most one R"));
  }

  TEST_CASE("an R for a micro-batch that is not checkpointed is refused by plan") {
    // Decided: meaningless, since such a cell kept its activations; refusing it catches a
    // schedule written for another checkpoint mode.
    listed s{{F(0, 0), R(0, 0), B(0, 0), F(1, 0), R(1, 0), B(1, 0)}};
    CHECK_FALSE(sched::check(s, 1, 2));
    CHECK(sched::plan(s, 1, 2, 2).size() == 6);
    CHECK(contains(error_of([&] { (void)sched::plan(s, 1, 2, 1); }),
                   "stagewise::schedule::plan: R1@0 (action #4) recomputes micro-batch 1, which is "
                   "not checkpointed (micro-batches 0..0 are); a cell that is not checkpointed "
                   "keeps its activations, so there is nothing to recompute"));
    CHECK(contains(error_of([&] { (void)sched::plan(s, 1, 2, 0); }),
                   "which is not checkpointed (no micro-batch is)"));
  }

  TEST_CASE("an early recompute is simulated where the schedule put it") {
    const int k = 3;
    const int m = 6;
    auto p = sched::plan(early_recompute{}, k, m, m);
    // Every checkpointed cell has exactly one R; none added before the last micro-batch's B.
    int rs = 0;
    for (const auto& prog : p.programs) {
      for (const auto& a : prog) rs += a.kind == ActionKind::recompute;
    }
    CHECK(rs == k * m);
    const auto& last = p.programs[2];  // stage 2 runs B0 before F1: plan puts R0 before B0
    CHECK(std::vector<Action>(last.begin(), last.begin() + 4) ==
          std::vector<Action>{F(0, 2), R(0, 2), B(0, 2), F(1, 2)});
    const auto& first = p.programs[0];  // stage 0: F0 F1 R0 F2 R1 B0 ...
    CHECK(std::vector<Action>(first.begin(), first.begin() + 6) ==
          std::vector<Action>{F(0, 0), F(1, 0), R(0, 0), F(2, 0), R(1, 0), B(0, 0)});
    auto sim = sched::simulate(p, sched::Costs{1, 1, 1, 1});
    CHECK(sim.timeline.actions.size() == static_cast<std::size_t>(3 * k * m));
  }
}
