#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/verify.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using sched::Action;
using sched::ActionKind;
using stagewise::coro::generator;
using stagewise::testing::contains;
using stagewise::testing::error_of;

static_assert(sched::pipeline_schedule<sched::gpipe>);
static_assert(sched::pipeline_schedule<sched::one_f_one_b>);
static_assert(sched::pipeline_schedule<sched::interleaved_one_f_one_b>);
static_assert(sched::pipeline_schedule<sched::zero_bubble_h1>);
static_assert(!sched::pipeline_schedule<int>);
static_assert(!sched::pipeline_schedule<generator<Action> (*)(int)>);
static_assert(sched::interleaved_schedule<sched::interleaved_one_f_one_b>);
static_assert(!sched::interleaved_schedule<sched::one_f_one_b>);

namespace {

// A schedule given as a fixed list of actions: for the broken cases.
struct listed {
  std::vector<Action> actions;
  generator<Action> operator()(int, int) const {
    for (const auto& a : actions) co_yield a;
  }
};

Action F(int micro, int stage) {
  return {stage, ActionKind::forward, micro};
}
Action B(int micro, int stage) {
  return {stage, ActionKind::backward, micro};
}
Action I(int micro, int stage) {
  return {stage, ActionKind::input_grad, micro};
}
Action W(int micro, int stage) {
  return {stage, ActionKind::weight_grad, micro};
}

// GPipe on two stages and two micro-batches, valid; the broken cases edit it.
std::vector<Action> valid_2x2() {
  return {F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(1, 1), B(0, 1), B(1, 0), B(0, 0)};
}

std::string problem(std::vector<Action> actions, int n = 2, int m = 2) {
  return error_of([&] { sched::verify(listed{std::move(actions)}, n, m); });
}

// Eager schedule written by a user: all forwards, then backwards in ascending order.
generator<Action> forwards_then_ascending(int stages, int micro_batches) {
  for (int s = 0; s < stages; ++s) {
    for (int i = 0; i < micro_batches; ++i) co_yield Action{s, ActionKind::forward, i};
    for (int i = 0; i < micro_batches; ++i) co_yield Action{s, ActionKind::backward, i};
  }
}

std::vector<Action> stage_order(const sched::Plan& p, int stage) {
  std::vector<Action> out;
  for (const auto& a : p.programs[static_cast<std::size_t>(p.worker_of(stage))]) {
    if (a.stage == stage) out.push_back(a);
  }
  return out;
}

}  // namespace

TEST_SUITE("schedules") {
  TEST_CASE("every built-in schedule passes the verifier for any stages and micro-batches") {
    for (int k = 1; k <= 5; ++k) {
      for (int m = 1; m <= 10; ++m) {
        CAPTURE(k);
        CAPTURE(m);
        CHECK_FALSE(sched::check(sched::gpipe{}, k, m));
        CHECK_FALSE(sched::check(sched::one_f_one_b{}, k, m));
        CHECK_FALSE(sched::check(sched::zero_bubble_h1{}, k, m));
        for (int v = 1; v <= 3; ++v)
          CHECK_FALSE(sched::check(sched::interleaved_one_f_one_b{v}, k * v, m));
      }
    }
  }

  TEST_CASE("1F1B warms up K-1-s forwards, then alternates, backwards in micro-batch order") {
    auto p = sched::plan(sched::one_f_one_b{}, 3, 4);
    CHECK(p.programs[0] == std::vector<Action>{F(0, 0), F(1, 0), F(2, 0), B(0, 0), F(3, 0), B(1, 0),
                                               B(2, 0), B(3, 0)});
    CHECK(p.programs[2] == std::vector<Action>{F(0, 2), B(0, 2), F(1, 2), B(1, 2), F(2, 2), B(2, 2),
                                               F(3, 2), B(3, 2)});
  }

  TEST_CASE("ZB-H1 splits every backward into I then W and holds stage s's W back by s") {
    auto p = sched::plan(sched::zero_bubble_h1{}, 2, 3);
    CHECK(p.programs[1] == std::vector<Action>{F(0, 1), I(0, 1), F(1, 1), I(1, 1), W(0, 1), F(2, 1),
                                               I(2, 1), W(1, 1), W(2, 1)});
    CHECK(p.programs[0] == std::vector<Action>{F(0, 0), F(1, 0), I(0, 0), W(0, 0), F(2, 0), I(1, 0),
                                               W(1, 0), I(2, 0), W(2, 0)});
  }

  TEST_CASE(
      "interleaved puts stage k on worker k % K and runs each virtual stage's cells in order") {
    const sched::interleaved_one_f_one_b il{2};
    CHECK(il.workers(8) == 4);
    auto p = sched::plan(il, 8, 8);
    REQUIRE(p.workers == 4);
    for (int w = 0; w < 4; ++w) {
      for (const auto& a : p.programs[static_cast<std::size_t>(w)]) CHECK(a.stage % 4 == w);
    }
    // Worker 0 starts with micro-batches 0..3 on stage 0, then the same on stage 4.
    CHECK(std::vector<Action>(p.programs[0].begin(), p.programs[0].begin() + 8) ==
          std::vector<Action>{F(0, 0), F(1, 0), F(2, 0), F(3, 0), F(0, 4), F(1, 4), F(2, 4),
                              F(3, 4)});
    for (int s = 0; s < 8; ++s) {
      int next = 0;
      for (const auto& a : stage_order(p, s)) {
        if (a.kind == ActionKind::backward) CHECK(a.micro == next++);
      }
    }
    CHECK(contains(error_of([&] { (void)il.workers(7); }),
                   "7 stages do not split into 2 virtual stages per worker"));
    CHECK(contains(error_of([] { (void)sched::interleaved_one_f_one_b{0}.workers(4); }),
                   "virtual_stages must be at least 1"));
  }

  TEST_CASE("plan inserts a recompute before the first backward of each checkpointed micro-batch") {
    auto p = sched::plan(sched::zero_bubble_h1{}, 2, 3, /*checkpointed=*/2);
    const Action r0{1, ActionKind::recompute, 0};
    const Action r1{1, ActionKind::recompute, 1};
    CHECK(p.programs[1] == std::vector<Action>{F(0, 1), r0, I(0, 1), F(1, 1), r1, I(1, 1), W(0, 1),
                                               F(2, 1), I(2, 1), W(1, 1), W(2, 1)});
    CHECK(p.size() == 2 * 3 * 3 + 4);
  }

  TEST_CASE("a schedule written by the user as a coroutine plugs in") {
    CHECK_FALSE(sched::check(forwards_then_ascending, 3, 4));
    auto lambda = [](int stages, int micro_batches) -> generator<Action> {
      for (int s = 0; s < stages; ++s) {
        for (int i = 0; i < micro_batches; ++i) {
          co_yield Action{s, ActionKind::forward, i};
          co_yield Action{s, ActionKind::backward, i};
        }
      }
    };
    static_assert(sched::pipeline_schedule<decltype(lambda)>);
    // One micro-batch at a time is valid but serial: the simulator shows the cost.
    auto sim = sched::simulate(lambda, 3, 4);
    CHECK(sim.makespan() == doctest::Approx(4 * 3 * 3));
    CHECK(sim.max_in_flight() == 1);
  }
}

TEST_SUITE("verify") {
  TEST_CASE("a valid list passes") {
    CHECK(problem(valid_2x2()) == "(no error)");
  }

  TEST_CASE("a backward before its forward is named") {
    auto a = valid_2x2();
    std::swap(a[2], a[4]);  // B1@1 before F0@1 and F1@1
    auto msg = problem(a);
    CHECK(contains(msg,
                   "stagewise::schedule::verify: B1@1 (action #2) comes before F1@1 on stage 1"));
    CHECK(contains(msg, "runs a micro-batch's forward before its backward"));
  }

  TEST_CASE("W before its I, W after B, and a missing W are named") {
    CHECK(contains(problem({F(0, 0), W(0, 0), I(0, 0)}, 1, 1),
                   "W0@0 (action #1) comes before I0@0 on stage 0"));
    CHECK(contains(problem({F(0, 0), B(0, 0), W(0, 0)}, 1, 1),
                   "W0@0 (action #2) follows B0@0, which already computed the weight gradients"));
    CHECK(contains(problem({F(0, 0), I(0, 0)}, 1, 1),
                   "W0@0 never comes; I0@0 left the weight gradients"));
  }

  TEST_CASE("cells run twice or never are named") {
    auto twice = valid_2x2();
    twice.insert(twice.begin() + 1, F(0, 0));
    CHECK(contains(problem(twice),
                   "F0@0 (action #1) repeats the forward of micro-batch 0 on stage 0"));
    auto again = valid_2x2();
    again.push_back(I(0, 0));
    CHECK(contains(problem(again),
                   "I0@0 (action #8) repeats the backward of micro-batch 0 on stage 0"));
    auto missing = valid_2x2();
    missing.pop_back();
    CHECK(contains(problem(missing),
                   "no backward of micro-batch 0 on stage 0; yield B0@0, or I0@0 and then W0@0"));
    CHECK(contains(problem({F(0, 0), B(0, 0)}, 1, 2), "F1@0 never comes"));
  }

  TEST_CASE("actions outside the grid and of unknown kinds are rejected") {
    CHECK(contains(problem({F(2, 0)}),
                   "F2@0 (action #0) is outside the pipeline of 2 stages and 2 micro-batches"));
    CHECK(contains(problem({F(0, -1)}), "yield stages 0..1 and micro-batches 0..1"));
    CHECK(contains(problem({F(0, 0), Action{0, static_cast<ActionKind>('X'), 0}}, 1, 1),
                   "action #1 has the unknown kind 'X'"));
    CHECK(contains(problem({}, 0, 2), "at least 1 stage and 1 micro-batch"));
  }

  TEST_CASE("a deadlock is found before anything runs, naming the first stuck action") {
    // Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1 forward, but stage 1
    // runs both forwards before any backward.
    std::vector<Action> a{F(0, 0), B(0, 0), F(1, 0), B(1, 0), F(0, 1), F(1, 1), B(0, 1), B(1, 1)};
    auto msg = problem(a);
    CHECK(contains(msg, "stagewise::schedule::verify: deadlock at B0@0 (action #1)"));
    CHECK(
        contains(msg, "worker 0 waits at B0@0 for B0@1 or I0@1; worker 1 waits at F1@1 for F1@0"));
    CHECK(contains(msg, "Order each worker's actions"));
    // The same actions in a workable order pass.
    CHECK(problem({F(0, 0), F(1, 0), B(0, 0), B(1, 0), F(0, 1), F(1, 1), B(0, 1), B(1, 1)}) ==
          "(no error)");
  }

  TEST_CASE("check returns the message, verify throws it, plan refuses to lay it out") {
    listed broken{{F(0, 0), B(1, 0)}};
    auto msg = sched::check(broken, 1, 2);
    REQUIRE(msg);
    CHECK(contains(*msg, "B1@0 (action #1) comes before F1@0"));
    CHECK(contains(error_of([&] { (void)sched::plan(broken, 1, 2); }), *msg));
    CHECK(contains(error_of([&] { (void)sched::simulate(broken, 1, 2); }), *msg));
  }
}

TEST_SUITE("simulate") {
  TEST_CASE("GPipe and 1F1B idle (K-1)/(M+K-1) of the time") {
    for (const auto& costs :
         {sched::Costs{}, sched::Costs{1.0, 2.0, 0.5}, sched::Costs{1.0, 1.0, 0.0}}) {
      for (int k : {1, 2, 3, 4}) {
        for (int m : {1, 2, 4, 8}) {
          CAPTURE(k);
          CAPTURE(m);
          const double expected = double(k - 1) / double(m + k - 1);
          const double full = costs.forward + costs.input_grad + costs.weight_grad;
          auto g = sched::simulate(sched::gpipe{}, k, m, costs);
          auto o = sched::simulate(sched::one_f_one_b{}, k, m, costs);
          CHECK(g.bubble() == doctest::Approx(expected));
          CHECK(o.bubble() == doctest::Approx(expected));
          CHECK(g.makespan() == doctest::Approx((m + k - 1) * full));
          CHECK(o.makespan() == doctest::Approx((m + k - 1) * full));
          for (int w = 0; w < k; ++w) CHECK(o.idle(w) == doctest::Approx((k - 1) * full));
        }
      }
    }
  }

  TEST_CASE("1F1B holds at most K micro-batches in flight where GPipe holds M") {
    for (int k : {2, 4}) {
      auto g = sched::simulate(sched::gpipe{}, k, 8);
      auto o = sched::simulate(sched::one_f_one_b{}, k, 8);
      CHECK(g.max_in_flight() == 8);
      CHECK(o.max_in_flight() == k);
      CHECK(g.total_peak_in_flight == 8 * k);
      CHECK(o.total_peak_in_flight == k * (k + 1) / 2);
      for (int s = 0; s < k; ++s) {
        CHECK(g.peak_in_flight[static_cast<std::size_t>(s)] == 8);
        CHECK(o.peak_in_flight[static_cast<std::size_t>(s)] == k - s);
      }
    }
  }

  TEST_CASE("interleaving v virtual stages per worker divides the idle time by v") {
    for (int k : {2, 3, 4}) {
      for (int v : {2, 3, 4}) {
        for (int groups : {1, 2, 3}) {
          const int m = k * groups;
          CAPTURE(k);
          CAPTURE(v);
          CAPTURE(m);
          // The same model cut into v times as many stages: each stage costs 1/v.
          const sched::Costs whole{1.0, 1.0, 1.0};
          const sched::Costs part{1.0 / v, 1.0 / v, 1.0 / v};
          auto plain = sched::simulate(sched::one_f_one_b{}, k, m, whole);
          auto il = sched::simulate(sched::interleaved_one_f_one_b{v}, k * v, m, part);
          for (int w = 0; w < k; ++w) CHECK(il.idle(w) == doctest::Approx(plain.idle(w) / v));
          const double bubble = (k - 1.0) / v / (m + (k - 1.0) / v);
          CHECK(il.bubble() == doctest::Approx(bubble));
        }
      }
    }
  }

  TEST_CASE("ZB-H1 idles (K-1)(T_F+T_B-T_W), a third of 1F1B's with equal costs, at 1F1B's peak") {
    for (const auto& costs :
         {sched::Costs{}, sched::Costs{1.0, 2.0, 1.0}, sched::Costs{2.0, 1.0, 1.0}}) {
      for (int k : {1, 2, 3, 4, 5}) {
        for (int m = k; m <= 3 * k; ++m) {
          CAPTURE(k);
          CAPTURE(m);
          auto z = sched::simulate(sched::zero_bubble_h1{}, k, m, costs);
          auto o = sched::simulate(sched::one_f_one_b{}, k, m, costs);
          for (int w = 0; w < k; ++w) {
            CHECK(z.idle(w) == doctest::Approx((k - 1) * (costs.forward + costs.input_grad -
                                                          costs.weight_grad)));
          }
          CHECK(z.max_in_flight() == o.max_in_flight());
          // Every stage, not only the first, holds K: more in all when stages share one memory.
          CHECK(z.total_peak_in_flight >= o.total_peak_in_flight);
        }
      }
    }
    auto z = sched::simulate(sched::zero_bubble_h1{}, 4, 8);
    auto o = sched::simulate(sched::one_f_one_b{}, 4, 8);
    CHECK(z.idle(0) == doctest::Approx(o.idle(0) / 3));
  }

  TEST_CASE("recomputes cost time and come right before their backward") {
    auto plain = sched::simulate(sched::one_f_one_b{}, 2, 4);
    auto ckpt = sched::simulate(sched::one_f_one_b{}, 2, 4, sched::Costs{}, 4);
    CHECK(ckpt.timeline.actions.size() == plain.timeline.actions.size() + 8);
    CHECK(ckpt.makespan() > plain.makespan());
    auto r = sched::simulate(
        sched::gpipe{}, 1, 2,
        sched::Costs{.forward = 1, .input_grad = 1, .weight_grad = 1, .recompute = 5}, 2);
    CHECK(r.makespan() == doctest::Approx(2 * 1 + 2 * (5 + 2)));
  }

  TEST_CASE("each action may have its own cost, e.g. the time it took in a recorded step") {
    // 1F1B on 2 stages, 2 micro-batches, every action 1 except the second stage's first forward:
    // worker 0 runs F0 F1 B0 B1, worker 1 runs F0 B0 F1 B1. F0@1 holds up B0@0 until 5 and B1@0
    // until 7.
    const auto p = sched::plan(sched::one_f_one_b{}, 2, 2);
    auto sim = sched::simulate(p, [](const sched::Action& a) {
      return a.kind == sched::ActionKind::forward && a.stage == 1 && a.micro == 0 ? 3.0 : 1.0;
    });
    CHECK(sim.makespan() == doctest::Approx(8.0));
    std::vector<std::string> order;
    std::vector<double> starts;
    for (const auto& t : sim.timeline.actions) {
      if (t.worker != 0) continue;
      order.push_back(sched::to_string(t.action));
      starts.push_back(t.start);
    }
    CHECK(order == std::vector<std::string>{"F0@0", "F1@0", "B0@0", "B1@0"});
    CHECK(starts == std::vector<double>{0.0, 1.0, 5.0, 7.0});
    // Fed the costs of a Costs value, it is the same simulation, action by action.
    const auto zb = sched::plan(sched::zero_bubble_h1{}, 4, 8);
    const sched::Costs costs{.forward = 2, .input_grad = 1, .weight_grad = 0.5};
    auto by_kind = sched::simulate(zb, costs);
    auto by_action = sched::simulate(zb, [&](const sched::Action& a) { return costs.of(a.kind); });
    REQUIRE(by_kind.timeline.actions.size() == by_action.timeline.actions.size());
    for (std::size_t i = 0; i < by_kind.timeline.actions.size(); ++i) {
      CHECK(by_kind.timeline.actions[i].action == by_action.timeline.actions[i].action);
      CHECK(by_kind.timeline.actions[i].start == by_action.timeline.actions[i].start);
    }
    CHECK(by_kind.worker_peak_in_flight == by_action.worker_peak_in_flight);
    CHECK(contains(error_of([&] {
                     (void)sched::simulate(p, [](const sched::Action& a) {
                       return a.kind == sched::ActionKind::backward ? -1.0 : 1.0;
                     });
                   }),
                   "the cost of B0@1 is -1; give costs of 0 or more"));
  }

  TEST_CASE("the timeline keeps each worker's order and never overlaps a worker's actions") {
    auto sim = sched::simulate(sched::interleaved_one_f_one_b{2}, 8, 8);
    CHECK(sim.timeline.actions.size() == 2 * 8 * 8);
    CHECK(sim.timeline.workers == 4);
    CHECK(sim.timeline.unit == "T");
    for (int w = 0; w < 4; ++w) {
      double last = 0.0;
      for (const auto& a : sim.timeline.actions) {
        if (a.worker != w) continue;
        CHECK(a.start >= last);
        last = a.end;
      }
    }
    CHECK(contains(
        error_of([] { (void)sched::simulate(sched::gpipe{}, 2, 2, sched::Costs{.forward = -1}); }),
        "the cost of F is -1; give costs of 0 or more"));
  }
}
