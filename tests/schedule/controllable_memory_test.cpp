// V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362):
// the V placement, the verifiers, the paper's peak activations per worker (exact), their step
// time against 1F1B on the simulator's clock, and PyTorch's CSV.
#include "stagewise/schedule/comms.hpp"
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/reductions.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/verify.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

namespace sched = stagewise::schedule;
using stagewise::testing::contains;
using stagewise::testing::error_of;

static_assert(sched::placed_schedule<sched::v_half>);
static_assert(sched::placed_schedule<sched::v_min>);

namespace {

// The paper's table: activation memory in micro-batches of a whole worker's model, for p
// workers: 1F1B p, V-Half (p+2)//2, V-Min (p+4)//3. A V cell is half a worker's model.
int half_micro_batches(int k) { return (k + 2) / 2; }
int min_micro_batches(int k) { return (k + 4) / 3; }

}  // namespace

TEST_SUITE("V-Half and V-Min") {
  TEST_CASE("they place stages w and 2K-1-w on worker w and need an even number of stages") {
    CHECK(sched::placement_of(sched::v_half{}, 8) == std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0});
    CHECK(sched::placement_of(sched::v_min{}, 4) == std::vector<int>{0, 1, 1, 0});
    CHECK(contains(error_of([] { (void)sched::v_half{}.workers(5); }),
                   "stagewise::schedule::v_half: 5 stages do not make a V; V-Half places 2 "
                   "stages on each worker"));
    CHECK(contains(error_of([] { sched::verify(sched::v_min{}, 3, 4); }),
                   "stagewise::schedule::v_min: 3 stages do not make a V; V-Min places 2"));
  }

  TEST_CASE("they pass the verifier, the message check and the reduction check") {
    for (int k = 1; k <= 6; ++k) {
      for (int m = 1; m <= 14; ++m) {
        CAPTURE(k);
        CAPTURE(m);
        CHECK_FALSE(sched::check(sched::v_half{}, 2 * k, m));
        CHECK_FALSE(sched::check(sched::v_min{}, 2 * k, m));
        for (int checkpointed : {0, m}) {
          for (const auto& p : {sched::plan(sched::v_half{}, 2 * k, m, checkpointed),
                                sched::plan(sched::v_min{}, 2 * k, m, checkpointed)}) {
            CHECK(sched::check_comms(p) == std::nullopt);
            CHECK(sched::check_comms(p, {{0, 2 * k - 1}, {0, k}}) == std::nullopt);
            CHECK_FALSE(sched::check_reductions(p).has_value());
          }
        }
      }
    }
  }

  TEST_CASE("every worker holds the paper's peak: (K+2)/2 and (K+4)/3 micro-batches, 1F1B K") {
    for (int k : {2, 3, 4, 5, 6, 8, 12, 16}) {
      for (int m : {k, 2 * k, 3 * k}) {
        CAPTURE(k);
        CAPTURE(m);
        const auto half = sched::simulate(sched::v_half{}, 2 * k, m);
        const auto min = sched::simulate(sched::v_min{}, 2 * k, m);
        const auto zbv = sched::simulate(sched::zero_bubble_v{}, 2 * k, m);
        const auto ofob = sched::simulate(sched::one_f_one_b{}, k, m);
        CHECK(sched::v_half{}.peak_cells(2 * k) == 2 * half_micro_batches(k));
        CHECK(sched::v_min{}.peak_cells(2 * k) == 2 * min_micro_batches(k));
        for (int w = 0; w < k; ++w) {
          const auto wi = static_cast<std::size_t>(w);
          CHECK(half.worker_peak_in_flight[wi] == 2 * half_micro_batches(k));
          CHECK(min.worker_peak_in_flight[wi] == 2 * min_micro_batches(k));
          // 1F1B's K, in half-model cells, once ZB-V's warm-up fills (M >= 2K - 1).
          if (m >= 2 * k - 1) CHECK(zbv.worker_peak_in_flight[wi] == 2 * k);
        }
        CHECK(ofob.worker_peak_in_flight[0] == k);
      }
    }
    // Fewer micro-batches than the cap holds: all of them, two cells each.
    CHECK(sched::simulate(sched::v_half{}, 16, 3).worker_peak_in_flight[0] == 6);
    CHECK(sched::simulate(sched::v_min{}, 16, 1).worker_peak_in_flight[0] == 2);
  }

  TEST_CASE("V-Half is at least as fast as 1F1B, V-Min within 16%, on the simulator's clock") {
    // T_F = T_B = T_W per whole stage for 1F1B; a V stage is half of it.
    const sched::Costs half_stage{0.5, 0.5, 0.5};
    for (int k : {4, 6, 8, 12, 16}) {
      for (int m : {2 * k, 4 * k}) {
        CAPTURE(k);
        CAPTURE(m);
        const double ofob = sched::simulate(sched::one_f_one_b{}, k, m).makespan();
        const double half = sched::simulate(sched::v_half{}, 2 * k, m, half_stage).makespan();
        const double min = sched::simulate(sched::v_min{}, 2 * k, m, half_stage).makespan();
        const double zbv = sched::simulate(sched::zero_bubble_v{}, 2 * k, m, half_stage).makespan();
        CHECK(half <= ofob);
        CHECK(min <= 1.16 * ofob);
        CHECK(zbv <= half);  // memory is what V-Half gives up time for
      }
    }
    // K = 8, M = 16: V-Min as fast as 1F1B, V-Half 9% faster.
    const double ofob = sched::simulate(sched::one_f_one_b{}, 8, 16).makespan();
    CHECK(ofob == 69.0);
    CHECK(sched::simulate(sched::v_half{}, 16, 16, half_stage).makespan() <= 0.91 * ofob);
    CHECK(sched::simulate(sched::v_min{}, 16, 16, half_stage).makespan() <= 1.01 * ofob);
  }

  TEST_CASE("peak_bytes weighs cells by what they keep before and after I, and a backward's work") {
    for (const auto& p : {sched::plan(sched::one_f_one_b{}, 4, 8), sched::plan(sched::v_min{}, 8, 8),
                          sched::plan(sched::v_half{}, 8, 8), sched::plan(sched::gpipe{}, 3, 5)}) {
      const auto cells = sched::simulate(p).worker_peak_in_flight;
      const auto bytes = sched::peak_bytes(p, {sched::CellBytes{}});
      for (std::size_t w = 0; w < cells.size(); ++w) CHECK(bytes[w] == cells[w]);
    }
    // One stage, one micro-batch: F keeps 2, a backward works with 1 more; I leaves 3 for W.
    const sched::CellBytes b{2.0, 3.0, 1.0};
    CHECK(sched::peak_bytes(sched::plan(sched::one_f_one_b{}, 1, 1), {b}) == std::vector<double>{3});
    const auto zb = sched::plan(sched::zero_bubble_h1{}, 1, 2);  // F0 I0 W0 F1 I1 W1 or similar
    CHECK(sched::peak_bytes(zb, {sched::CellBytes{2.0, 5.0, 0.0}})[0] >= 5.0);
    // Per stage: stage 1 twice as heavy.
    const auto two = sched::plan(sched::gpipe{}, 2, 2);
    CHECK(sched::peak_bytes(two, {{1.0, 1.0, 0.0}, {2.0, 2.0, 0.0}}) == std::vector<double>{2, 4});
    CHECK(contains(error_of([&] { (void)sched::peak_bytes(two, {{}, {}, {}}); }),
                   "give one CellBytes for every stage (2), or one for all; got 3"));
  }

  TEST_CASE("PyTorch's CSV carries them: from_csv(to_csv(plan)) plans the same programs") {
    for (int checkpointed : {0, 8}) {
      for (const auto& p : {sched::plan(sched::v_half{}, 8, 8, checkpointed),
                            sched::plan(sched::v_min{}, 8, 8, checkpointed)}) {
        const auto text = sched::to_csv(p, checkpointed > 0);
        const auto c = sched::from_csv(text);
        const auto q = sched::plan(c, 8, 8, checkpointed);
        CHECK(q.workers == 4);
        CHECK(q.programs == p.programs);
        for (int s = 0; s < 8; ++s) CHECK(q.worker_of(s) == p.worker_of(s));
      }
    }
  }

  TEST_CASE("V-Min's first worker on 2 workers and 4 micro-batches, action by action") {
    using K = sched::ActionKind;
    const auto p = sched::plan(sched::v_min{}, 4, 4);
    // Three micro-batches down (the fourth cell is the one kept free for the way up), the turn,
    // then W passes free cells before the next F.
    const std::vector<sched::Action> expected{
        {0, K::forward, 0},    {0, K::forward, 1},     {0, K::forward, 2},
        {3, K::forward, 0},    {3, K::input_grad, 0},  {3, K::weight_grad, 0},
        {3, K::forward, 1},    {0, K::input_grad, 0},  {3, K::input_grad, 1},
        {0, K::weight_grad, 0}, {3, K::weight_grad, 1}};
    CHECK(std::vector<sched::Action>(p.programs[0].begin(), p.programs[0].begin() + 11) ==
          expected);
  }
}
