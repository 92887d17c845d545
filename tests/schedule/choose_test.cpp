// schedule::choose: the fastest schedule whose simulated peak activations fit a per-worker limit,
// with why each faster one was rejected; any_schedule, which carries the answer to the pipe.
#include "stagewise/schedule/choose.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using sched::ActivationLimit;
using stagewise::testing::contains;
using stagewise::testing::error_of;

namespace {

std::vector<std::string> names(const sched::Choice& c) {
  std::vector<std::string> out;
  for (const auto& e : c.all) out.push_back(e.name);
  return out;
}

}  // namespace

TEST_SUITE("choose") {
  TEST_CASE("any_schedule runs, places and simulates like the schedule it holds") {
    const sched::any_schedule v("v_min", sched::v_min{});
    CHECK(v.name() == "v_min");
    CHECK(sched::placement_of(v, 8) == sched::placement_of(sched::v_min{}, 8));
    CHECK(sched::plan(v, 8, 8).programs == sched::plan(sched::v_min{}, 8, 8).programs);
    const sched::any_schedule o("1f1b", sched::one_f_one_b{});
    CHECK(sched::placement_of(o, 3) == std::vector<int>{0, 1, 2});
    CHECK(sched::plan(o, 3, 5).programs == sched::plan(sched::one_f_one_b{}, 3, 5).programs);
    // The generator keeps the schedule alive after the any_schedule is gone.
    auto g = sched::any_schedule("zbv", sched::zero_bubble_v{})(4, 2);
    int n = 0;
    for (const auto& a : g) n += a.stage >= 0;
    CHECK(n == 4 * 2 * 3);
  }

  TEST_CASE("without a limit it returns the fastest schedule on the simulator's clock") {
    const auto c = sched::choose(4, 8, {}, ActivationLimit::none());
    CHECK(c.all.size() == 8);
    CHECK(c.chosen.name == c.all.front().name);
    CHECK(c.schedule.name() == c.chosen.name);
    for (std::size_t i = 1; i < c.all.size(); ++i) CHECK(c.all[i - 1].makespan <= c.all[i].makespan);
    CHECK(c.rejected().empty());
    // ZB-V: 3 M whole-stage actions per worker and a fill of (K-1) half stages.
    CHECK(c.chosen.name == "zero_bubble_v");
    CHECK(c.stages == 8);
    CHECK(c.chosen.makespan == doctest::Approx(3 * 8 + 3 * 0.5));
    CHECK(c.simulation.makespan() == doctest::Approx(c.chosen.makespan));
    // GPipe and 1F1B: (M + K - 1)(T_F + T_B + T_W); V-Min, the tightest memory, comes last at K = 4.
    for (const auto& e : c.all) {
      if (e.name == "gpipe" || e.name == "one_f_one_b") CHECK(e.makespan == 33.0);
    }
    CHECK(names(c).back() == "v_min");
  }

  TEST_CASE("a limit of 3 micro-batches picks V-Half, of 2 V-Min, and says why not the others") {
    // K = 4: 1F1B, ZB-H1, ZB-V hold 4 micro-batches on worker 0, DualPipeV 4.5, V-Half 3,
    // V-Min 2.
    const auto half = sched::choose(4, 8, {}, ActivationLimit::micro_batches(3));
    CHECK(half.schedule.name() == "v_half");
    CHECK(half.stages == 8);
    CHECK(half.chosen.peak_micro_batches == std::vector<double>{3, 3, 3, 3});
    const auto min = sched::choose(4, 8, {}, ActivationLimit::micro_batches(2));
    CHECK(min.schedule.name() == "v_min");
    CHECK(min.chosen.peak_micro_batches == std::vector<double>{2, 2, 2, 2});
    CHECK(min.chosen.fits);
    const auto why = min.rejected();
    REQUIRE(why.size() >= 3);
    CHECK(why[0] == "zero_bubble_v: step 25.5; worker 0 holds 4 micro-batches, over the limit of 2");
    bool half_named = false;
    for (const auto& w : why) {
      if (w.rfind("v_half: ", 0) == 0) {
        half_named = true;
        CHECK(contains(w, "worker 0 holds 3 micro-batches, over the limit of 2"));
      }
    }
    CHECK(half_named);
    CHECK(contains(min.report(), "* v_min: 8 stages, step "));
    CHECK(contains(min.report(), "  v_half: 8 stages, step "));
  }

  TEST_CASE("a limit in bytes uses each worker's bytes per micro-batch") {
    // 100 bytes per micro-batch on every worker but the first, which holds 120: 250 bytes allow
    // V-Min (2 micro-batches, 240 bytes on worker 0), not V-Half (360).
    const auto c = sched::choose(4, 8, {}, ActivationLimit::bytes(250, {120, 100, 100, 100}));
    CHECK(c.schedule.name() == "v_min");
    CHECK(c.chosen.peak_bytes == std::vector<double>{240, 200, 200, 200});
    bool half_named = false;
    for (const auto& w : c.rejected()) {
      if (w.rfind("v_half: ", 0) == 0) {
        half_named = true;
        CHECK(contains(w, "worker 0 holds 3 micro-batches, 360 bytes, over the limit of 250"));
      }
    }
    CHECK(half_named);
  }

  TEST_CASE("a limit in CellBytes counts what a cell keeps after its I until its W") {
    // A cell that keeps twice as much between I and W (an MLP: the layer inputs and the output
    // gradients): V-Min holds 2 micro-batches in cells, but its peak in bytes is what
    // peak_bytes says, and a split-backward schedule may no longer fit where 1F1B, whose B frees
    // the cell at once, does.
    const sched::CellBytes cell{100.0, 200.0, 0.0, 0.0};
    const auto c = sched::choose(4, 8, {}, ActivationLimit::cell_bytes(400, {cell}));
    for (const auto& e : c.all) {
      CAPTURE(e.name);
      if (e.name == "one_f_one_b") {
        CHECK(e.fits);
        CHECK(e.peak_bytes[0] == 400.0);  // K cells of 100 on worker 0
      }
      if (e.name == "v_min") {
        CHECK(e.peak_bytes.size() == 4);
        const auto p = sched::plan(sched::v_min{}, 8, 8);
        CHECK(e.peak_bytes == sched::peak_bytes(p, {sched::CellBytes{50.0, 100.0, 0.0, 0.0}}));
      }
    }
    CHECK(c.chosen.fits);
    CHECK(c.chosen.peak_bytes[0] <= 400.0);
  }

  TEST_CASE("a schedule that cannot run is rejected with its own error") {
    // DualPipeV needs M >= 2K.
    const auto c = sched::choose(4, 6, {}, ActivationLimit::none());
    for (const auto& e : c.all) {
      if (e.name != "dualpipe_v") continue;
      CHECK_FALSE(e.fits);
      CHECK(contains(e.why_not, "cannot run here: stagewise::schedule::dualpipe_v: 6 "
                                "micro-batches for 4 workers"));
    }
    CHECK(c.schedule.name() != "dualpipe_v");
  }

  TEST_CASE("when nothing fits the error names every schedule's peak and the ways out") {
    const auto e = error_of([] { sched::choose(4, 8, {}, ActivationLimit::micro_batches(1.5)); });
    CHECK(contains(e, "stagewise::schedule::choose: no schedule fits the activation limit on 4 "
                      "workers with 8 micro-batches:"));
    CHECK(contains(e, "v_min: step "));
    CHECK(contains(e, "worker 0 holds 2 micro-batches, over the limit of 1.5"));
    CHECK(contains(e, "Raise the limit, checkpoint"));
    CHECK(contains(error_of([] { (void)ActivationLimit::micro_batches(0); }),
                   "the limit is 0; give a positive number of micro-batches"));
    CHECK(contains(error_of([] { (void)ActivationLimit::bytes(10, {}); }),
                   "give the bytes of one micro-batch's activations on each worker"));
    CHECK(contains(error_of([] { sched::choose(0, 8, {}, ActivationLimit::none()); }),
                   "0 workers and 8 micro-batches; give 1 or more of each"));
  }

  TEST_CASE("costs decide between schedules that fit: a slow W favours the split backward less") {
    // With W free, 1F1B's B costs T_F + T_B; the ranking follows the simulator for those costs.
    const sched::Costs costs{1.0, 2.0, 0.0};
    const auto c = sched::choose(2, 4, costs, ActivationLimit::none());
    for (const auto& e : c.all) {
      CHECK(e.makespan > 0);
      CHECK(e.makespan >= c.chosen.makespan);
    }
    const auto o = sched::simulate(sched::one_f_one_b{}, 2, 4, costs).makespan();
    for (const auto& e : c.all) {
      if (e.name == "one_f_one_b") CHECK(e.makespan == doctest::Approx(o));
    }
  }
}
