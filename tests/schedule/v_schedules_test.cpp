// Looped BFS, ZB-V and DualPipeV: placement, validity, and the papers' closed forms for idle
// time and peak activations, checked against the simulator.
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/verify.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using sched::Action;
using sched::ActionKind;
using stagewise::testing::contains;
using stagewise::testing::error_of;

static_assert(sched::pipeline_schedule<sched::looped_bfs>);
static_assert(sched::interleaved_schedule<sched::looped_bfs>);
static_assert(!sched::placed_schedule<sched::looped_bfs>);
static_assert(sched::placed_schedule<sched::zero_bubble_v>);
static_assert(sched::placed_schedule<sched::dualpipe_v>);
static_assert(!sched::placed_schedule<sched::interleaved_one_f_one_b>);
static_assert(!sched::placed_schedule<sched::one_f_one_b>);

namespace {

// A schedule that places 2 stages on one worker backwards: stage 0 on worker 1, stage 1 on 0.
struct swapped {
  int workers(int) const { return 2; }
  int worker_of(int stage, int) const { return 1 - stage; }
  stagewise::coro::generator<Action> operator()(int, int) const {
    co_yield Action{0, ActionKind::forward, 0};
    co_yield Action{1, ActionKind::forward, 0};
    co_yield Action{1, ActionKind::backward, 0};
    co_yield Action{0, ActionKind::backward, 0};
  }
};

// Puts stage 1 on a worker that does not exist.
struct off_the_end : swapped {
  int worker_of(int stage, int) const { return stage == 1 ? 2 : 0; }
};

}  // namespace

TEST_SUITE("placement") {
  TEST_CASE("a plan places stages as the schedule says: k % K, or w and 2K-1-w in a V") {
    CHECK(sched::placement_of(sched::one_f_one_b{}, 3) == std::vector<int>{0, 1, 2});
    CHECK(sched::placement_of(sched::interleaved_one_f_one_b{2}, 6) ==
          std::vector<int>{0, 1, 2, 0, 1, 2});
    CHECK(sched::placement_of(sched::looped_bfs{2}, 4) == std::vector<int>{0, 1, 0, 1});
    CHECK(sched::placement_of(sched::zero_bubble_v{}, 8) ==
          std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0});
    CHECK(sched::placement_of(sched::dualpipe_v{}, 4) == std::vector<int>{0, 1, 1, 0});
    auto p = sched::plan(sched::zero_bubble_v{}, 8, 8);
    CHECK(p.workers == 4);
    for (int w = 0; w < 4; ++w) {
      CHECK(p.stages_of(w) == std::vector<int>{w, 7 - w});
      for (const auto& a : p.programs[static_cast<std::size_t>(w)])
        CHECK(p.worker_of(a.stage) == w);
    }
    // A plan built by hand without a placement keeps k % workers.
    sched::Plan bare{4, 1, 2, {}, {}};
    CHECK(bare.worker_of(3) == 1);
  }

  TEST_CASE("the verifier and the simulator follow a user's placement") {
    auto p = sched::plan(swapped{}, 2, 1);
    CHECK(p.programs[1] ==
          std::vector<Action>{{0, ActionKind::forward, 0}, {0, ActionKind::backward, 0}});
    auto sim = sched::simulate(p);
    for (const auto& t : sim.timeline.actions) CHECK(t.worker == 1 - t.action.stage);
    CHECK(contains(error_of([] { sched::verify(off_the_end{}, 2, 1); }),
                   "worker_of(1, 2) is 2, outside the 2 workers; return 0..1"));
  }

  TEST_CASE("V-shaped schedules need an even number of stages and say so") {
    CHECK(contains(error_of([] { (void)sched::zero_bubble_v{}.workers(5); }),
                   "stagewise::schedule::zero_bubble_v: 5 stages do not make a V"));
    CHECK(contains(error_of([] { sched::verify(sched::dualpipe_v{}, 3, 8); }),
                   "DualPipeV places 2 stages on each worker"));
    CHECK(contains(error_of([] { (void)sched::looped_bfs{2}.workers(3); }),
                   "3 stages do not split into 2 virtual stages per worker"));
    CHECK(contains(error_of([] { sched::verify(sched::dualpipe_v{}, 8, 7); }),
                   "7 micro-batches for 4 workers; DualPipeV needs at least 2 x workers = 8"));
  }

  TEST_CASE("the new schedules pass the verifier for any workers and micro-batches") {
    for (int k = 1; k <= 5; ++k) {
      for (int m = 1; m <= 12; ++m) {
        CAPTURE(k);
        CAPTURE(m);
        CHECK_FALSE(sched::check(sched::zero_bubble_v{}, 2 * k, m));
        if (m >= 2 * k) CHECK_FALSE(sched::check(sched::dualpipe_v{}, 2 * k, m));
        for (int v = 1; v <= 3; ++v) CHECK_FALSE(sched::check(sched::looped_bfs{v}, k * v, m));
      }
    }
  }
}

// The closed forms. K workers, M micro-batches; a V or looped schedule cuts the model into v x K
// stages (v = 2 for the V), each costing 1/v of a whole stage: t_F, t_B, t_W per stage below.
TEST_SUITE("closed forms") {
  TEST_CASE("looped BFS idles (K-1)(T_F+T_B+T_W)/v per worker and holds v M cells per worker") {
    // Lamy-Poirier, arXiv 2211.05953: looping divides the bubble by v as interleaving does;
    // breadth-first keeps GPipe's memory. For M >= K.
    for (int k : {2, 3, 4}) {
      for (int v : {2, 3}) {
        for (int m = k; m <= 3 * k; ++m) {
          CAPTURE(k);
          CAPTURE(v);
          CAPTURE(m);
          const sched::Costs part{1.0 / v, 1.0 / v, 1.0 / v};
          auto sim = sched::simulate(sched::looped_bfs{v}, k * v, m, part);
          for (int w = 0; w < k; ++w) CHECK(sim.idle(w) == doctest::Approx(3.0 * (k - 1) / v));
          CHECK(sim.bubble() == doctest::Approx((k - 1.0) / (v * m + k - 1.0)));
          for (int w = 0; w < k; ++w)
            CHECK(sim.worker_peak_in_flight[static_cast<std::size_t>(w)] == v * m);
        }
      }
    }
  }

  TEST_CASE("ZB-V: no bubble but the fill, and 1F1B's peak activations on every worker") {
    // Qi et al., arXiv 2401.10241 (ZB-V; the authors' comparison assumes T_F = T_B = T_W):
    // bubble rate 0 and activation memory 1x of 1F1B. What remains is the fill that no schedule
    // avoids: worker K-1 cannot start before micro-batch 0 has passed K-1 half-stages, so every
    // worker idles (K-1) t_F, and the bubble is (K-1) t_F / (3 M T + (K-1) t_F) with T = 2 t.
    // Memory: at most 2K half-stage cells per worker, K whole micro-batches: 1F1B's stage 0.
    for (int k = 1; k <= 5; ++k) {
      for (int m = 2 * k - 1; m <= 4 * k; ++m) {
        CAPTURE(k);
        CAPTURE(m);
        const double t = 0.5;
        auto z = sched::simulate(sched::zero_bubble_v{}, 2 * k, m, sched::Costs{t, t, t});
        auto o = sched::simulate(sched::one_f_one_b{}, k, m);
        for (int w = 0; w < k; ++w) CHECK(z.idle(w) == doctest::Approx((k - 1) * t));
        CHECK(z.makespan() == doctest::Approx(3.0 * m + (k - 1) * t));
        CHECK(z.bubble() == doctest::Approx((k - 1) * t / (3.0 * m + (k - 1) * t)));
        for (int w = 0; w < k; ++w) {
          CHECK(z.worker_peak_in_flight[static_cast<std::size_t>(w)] == std::min(2 * k, 2 * m));
        }
        CHECK(z.worker_peak_in_flight[0] == 2 * o.worker_peak_in_flight[0]);  // same bytes
        CHECK(z.makespan() < o.makespan() + 1e-9);
      }
    }
  }

  TEST_CASE("DualPipeV idles (K-1)(F&B + B - 3W) per worker with 2K+1 cells per worker") {
    // DeepSeek-V3 (arXiv 2412.19437, table 2) and the DualPipe repository's table: bubble
    // (PP/2-1)(F&B + B - 3W) and PP+1 micro-batches of activations per device, for PP stages of
    // cost F, B (input gradient), W (weight gradient) each; DualPipeV runs PP = 2K stages on K
    // devices. stagewise runs an overlapped pair back to back, so F&B = F + B + W here. Exact
    // for T_F = T_B = T_W and for T_F = 2 T_B = 2 T_W (M >= 2K); with other costs the simulated
    // idle time differs (e.g. 4 instead of 3 for K = 2 and T_F = 3 T_B = 3 T_W).
    for (const auto& c : {sched::Costs{1, 1, 1}, sched::Costs{2, 1, 1}}) {
      for (int k = 1; k <= 5; ++k) {
        for (int m = 2 * k; m <= 4 * k; ++m) {
          CAPTURE(k);
          CAPTURE(m);
          CAPTURE(c.forward);
          auto d = sched::simulate(sched::dualpipe_v{}, 2 * k, m, c);
          const double pair = c.forward + c.input_grad + c.weight_grad;
          for (int w = 0; w < k; ++w) {
            CHECK(d.idle(w) ==
                  doctest::Approx((k - 1) * (pair + c.input_grad - 3 * c.weight_grad)));
            CHECK(d.worker_peak_in_flight[static_cast<std::size_t>(w)] == 2 * k + 1);
          }
        }
      }
    }
  }

  TEST_CASE("DualPipeV's steady state alternates F of one stage with B of the other") {
    auto p = sched::plan(sched::dualpipe_v{}, 4, 6);  // K = 2, M = 6
    // Worker 0 (stages 0 and 3): F0 F0 | F0 F3 | I3 W3 F3 | (F0 B3)(F3 B0) ...
    const std::vector<Action> start{{0, ActionKind::forward, 0},    {0, ActionKind::forward, 1},
                                    {0, ActionKind::forward, 2},    {3, ActionKind::forward, 0},
                                    {3, ActionKind::input_grad, 0}, {3, ActionKind::weight_grad, 0},
                                    {3, ActionKind::forward, 1},    {0, ActionKind::forward, 3},
                                    {3, ActionKind::backward, 1},   {3, ActionKind::forward, 2},
                                    {0, ActionKind::backward, 0}};
    CHECK(std::vector<Action>(p.programs[0].begin(), p.programs[0].begin() + 11) == start);
  }
}
