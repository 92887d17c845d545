// Offload O and reload L as schedule actions: the verifier's rules, the pass that places them from
// costs, and what the simulator, peak_bytes and the timelines make of them.
#include "stagewise/schedule/offload.hpp"
#include "stagewise/schedule/chrome_trace.hpp"
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/svg.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/verify.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"
#include "tests/support/listed_schedule.hpp"

#include <doctest/doctest.h>

#include <string>
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

int count(const sched::Plan& p, ActionKind k) {
  int n = 0;
  for (const auto& program : p.programs) {
    for (const auto& a : program) n += a.kind == k;
  }
  return n;
}

// Each O precedes its L, which precedes the cell's R, on the cell's own worker.
void check_order(const sched::Plan& p) {
  for (std::size_t w = 0; w < p.programs.size(); ++w) {
    const auto& program = p.programs[w];
    for (std::size_t k = 0; k < program.size(); ++k) {
      const Action& a = program[k];
      if (a.kind != ActionKind::offload) continue;
      CHECK(p.worker_of(a.stage) == static_cast<int>(w));
      std::size_t l = k, r = k;
      for (std::size_t q = k; q < program.size(); ++q) {
        if (program[q] == L(a.micro, a.stage)) l = q;
        if (program[q] == R(a.micro, a.stage)) r = q;
      }
      CHECK(k < l);
      CHECK(l < r);
    }
  }
}

}  // namespace

TEST_SUITE("offload actions") {
  TEST_CASE("O and L print with their letters; R stays the recompute") {
    CHECK(sched::to_string(O(3, 1)) == "O3@1");
    CHECK(sched::to_string(L(3, 1)) == "L3@1");
    CHECK(sched::is_copy(ActionKind::offload));
    CHECK(sched::is_copy(ActionKind::reload));
    CHECK_FALSE(sched::is_copy(ActionKind::recompute));
  }

  TEST_CASE("an offload reloaded once between its F and its use passes") {
    CHECK(problem({F(0, 0), O(0, 0), F(1, 0), L(0, 0), R(0, 0), B(0, 0), B(1, 0)}) == "(no error)");
    CHECK(problem({F(0, 0), O(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}) == "(no error)");
    CHECK(problem({F(0, 0), F(1, 0), O(0, 0), L(0, 0), I(0, 0), I(1, 0), W(0, 0), W(1, 0)}) ==
          "(no error)");
  }

  TEST_CASE("a reload after its use is refused, naming both") {
    const auto e = problem({F(0, 0), O(0, 0), F(1, 0), R(0, 0), L(0, 0), B(0, 0), B(1, 0)});
    CHECK(e ==
          "stagewise::schedule::verify: L0@0 (action #4) comes after R0@0 (action #3), "
          "which uses what O0@0 moved to the host; a reload must land before its use, so "
          "yield L0@0 before R0@0");
    CHECK(contains(problem({F(0, 0), O(0, 0), B(0, 0), L(0, 0), F(1, 0), B(1, 0)}),
                   "L0@0 (action #3) comes after B0@0 (action #2)"));
  }

  TEST_CASE("an offload never reloaded is refused") {
    const auto e = problem({F(0, 0), O(0, 0), F(1, 0), R(0, 0), B(0, 0), B(1, 0)});
    CHECK(e ==
          "stagewise::schedule::verify: O0@0 is never reloaded, but R0@0 (action #3) uses "
          "what it moved to the host; yield L0@0 between O0@0 and R0@0, or drop the "
          "offload");
  }

  TEST_CASE("O and L out of place are named") {
    CHECK(contains(problem({O(0, 0), F(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                   "O0@0 (action #0) comes before F0@0 on stage 0"));
    CHECK(contains(problem({F(0, 0), B(0, 0), O(0, 0), F(1, 0), B(1, 0)}),
                   "O0@0 (action #2) follows the cell's backward"));
    CHECK(contains(problem({F(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                   "L0@0 (action #1) reloads micro-batch 0 on stage 0, which has not been "
                   "offloaded"));
    CHECK(contains(problem({F(0, 0), O(0, 0), O(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                   "repeats the offload"));
    CHECK(contains(problem({F(0, 0), O(0, 0), L(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}),
                   "repeats the reload"));
    // On another stage it is another cell: stage 1's L has no O.
    CHECK(contains(problem({F(0, 0), O(0, 0), F(0, 1), L(0, 1), B(0, 1), L(0, 0), B(0, 0), F(1, 0),
                            F(1, 1), B(1, 1), B(1, 0)},
                           2, 2),
                   "L0@1 (action #3) reloads micro-batch 0 on stage 1, which has not been "
                   "offloaded"));
  }

  TEST_CASE("plan refuses an offload of a cell that is not checkpointed") {
    const auto e = error_of([] {
      (void)sched::plan(listed{{F(0, 0), O(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}}, 1, 2, 0);
    });
    CHECK(contains(e, "O0@0 (action #1) offloads micro-batch 0, which is not checkpointed"));
    // With the cell checkpointed, plan keeps the pair and puts the R after the L.
    auto p = sched::plan(listed{{F(0, 0), O(0, 0), L(0, 0), B(0, 0), F(1, 0), B(1, 0)}}, 1, 2, 1);
    CHECK(p.programs[0] ==
          std::vector<Action>{F(0, 0), O(0, 0), L(0, 0), R(0, 0), B(0, 0), F(1, 0), B(1, 0)});
    CHECK(sched::check(p) == std::nullopt);
  }

  TEST_CASE("the pass keeps a pair only where the gap hides the round trip") {
    const auto p = sched::plan(sched::gpipe{}, 2, 4, 4);
    // Free copies: every checkpointed cell is offloaded (GPipe's last forward on the last stage
    // meets its recompute at once, a gap of 0, which hides 0).
    const auto all = sched::offload(p, {.costs = {.offload = 0.0}});
    CHECK(count(all, ActionKind::offload) == 8);
    CHECK(count(all, ActionKind::reload) == 8);
    check_order(all);
    // Copies of 0.5 need a gap of 1.5: the cells whose recompute comes soon stay resident.
    const auto some = sched::offload(p, {.costs = {.offload = 0.5}});
    const int kept = count(some, ActionKind::offload);
    CHECK(kept > 0);
    CHECK(kept < 8);
    CHECK(sched::offloaded(some).size() == static_cast<std::size_t>(kept));
    for (auto c : sched::offloaded(some)) CHECK_FALSE((c.stage == 1 && c.micro == 3));
    check_order(some);
    // Copies too slow for any gap: nothing moves.
    CHECK(count(sched::offload(p, {.costs = {.offload = 100.0}}), ActionKind::offload) == 0);
    // Stage 0 can be left out.
    const auto no_first = sched::offload(p, {.costs = {.offload = 0.0}, .stages = {false, true}});
    for (auto c : sched::offloaded(no_first)) CHECK(c.stage == 1);
  }

  TEST_CASE("the pass works on every schedule, and its plans verify") {
    const sched::OffloadCosts costs{.costs = {.offload = 0.2}};
    auto run = [&](auto s, int n, int m) {
      const auto with = sched::offload(sched::plan(s, n, m, m), costs);
      CHECK(sched::check(with) == std::nullopt);
      check_order(with);
      CHECK(count(with, ActionKind::offload) > 0);
      CHECK(count(with, ActionKind::offload) == count(with, ActionKind::reload));
    };
    run(sched::gpipe{}, 4, 8);
    run(sched::one_f_one_b{}, 4, 8);
    run(sched::zero_bubble_h1{}, 4, 8);
    run(sched::interleaved_one_f_one_b{2}, 8, 8);
    run(sched::zero_bubble_v{}, 8, 8);
    run(sched::v_half{}, 8, 8);
  }

  TEST_CASE("copies run beside the compute: free-enough copies cost no step time") {
    const auto p = sched::plan(sched::one_f_one_b{}, 4, 8, 8);
    const sched::Costs costs{.offload = 0.2};
    const auto with = sched::offload(p, {.costs = costs});
    CHECK(sched::simulate(with, costs).makespan() ==
          doctest::Approx(sched::simulate(p, costs).makespan()));
    // A reload that cannot land in time delays its recompute.
    const sched::Costs slow{.offload = 0.2, .reload = 50.0};
    CHECK(sched::simulate(with, slow).makespan() > sched::simulate(p, slow).makespan() + 40.0);
  }

  TEST_CASE("peak_bytes drops what is offloaded between its O and L") {
    const auto p = sched::plan(sched::gpipe{}, 1, 4, 4);
    const std::vector<sched::CellBytes> bytes{{.forward = 10, .input_grad = 10, .kept = 2}};
    // GPipe, one stage, all checkpointed: 4 cells keep 2 each, then one recomputed at a time.
    CHECK(sched::peak_bytes(p, bytes)[0] == doctest::Approx(3 * 2 + 10));
    const auto with = sched::offload(p, {.costs = {.offload = 0.0}});
    CHECK(sched::peak_bytes(with, bytes)[0] < sched::peak_bytes(p, bytes)[0]);
    // Without `kept`, a checkpointed cell counts as a whole forward, as before.
    CHECK(sched::peak_bytes(p, {{.forward = 10, .input_grad = 10}})[0] == doctest::Approx(40));
  }

  TEST_CASE("timelines draw copies: thin SVG bars, a track of their own in Chrome traces") {
    const auto p =
        sched::offload(sched::plan(sched::gpipe{}, 2, 4, 4), {.costs = {.offload = 0.5}});
    const auto sim = sched::simulate(p, {.offload = 0.5});
    const std::string svg = sched::to_svg(sim.timeline);
    CHECK(contains(svg, "O offload"));
    CHECK(contains(svg, "L reload"));
    CHECK(contains(svg, "<title>O"));
    const std::string trace = sched::to_chrome_trace(sim.timeline);
    CHECK(contains(trace, "\"cat\":\"offload\""));
    CHECK(contains(trace, "\"cat\":\"reload\""));
    CHECK(contains(trace, "\"name\":\"copies 0\""));
    // The bubble counts compute only.
    CHECK(sim.timeline.bubble() ==
          doctest::Approx(sched::simulate(sched::plan(sched::gpipe{}, 2, 4, 4)).bubble()));
    // PyTorch's CSV grammar has no copies: they are left out.
    CHECK(sched::to_csv(p) == sched::to_csv(sched::plan(sched::gpipe{}, 2, 4, 4)));
  }

  TEST_CASE("the pass refuses a plan that already offloads") {
    const auto with =
        sched::offload(sched::plan(sched::gpipe{}, 2, 4, 4), {.costs = {.offload = 0.0}});
    CHECK(contains(error_of([&] { (void)sched::offload(with, {}); }),
                   "stagewise::schedule::offload: the plan already has O"));
  }
}
