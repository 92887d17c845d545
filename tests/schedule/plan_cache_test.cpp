// PlanCache: a plan is made once for a schedule and shape, and made again when any of them
// changes; schedules are told apart by their == or their value, never mixed up.
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan_cache.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sched = stagewise::schedule;

namespace {

// A schedule the cache cannot compare (a string, no ==): planned on every call.
struct named_1f1b {
  std::string name = "mine";
  stagewise::coro::generator<sched::Action> operator()(int stages, int micro) const {
    const sched::one_f_one_b s;
    for (const auto& a : s(stages, micro)) co_yield a;
  }
};

}  // namespace

TEST_SUITE("plan cache") {
  TEST_CASE("equal arguments give the same plan, made once; any change makes another") {
    sched::PlanCache plans;
    const std::vector<int> none(4, 0), all(4, 8);
    const auto a = plans.get(sched::one_f_one_b{}, 4, 8, none);
    const auto b = plans.get(sched::one_f_one_b{}, 4, 8, none);
    CHECK(a == b);
    CHECK(*a == sched::plan(sched::one_f_one_b{}, 4, 8, none));
    CHECK(plans.hits() == 1);
    CHECK(plans.misses() == 1);
    CHECK(plans.get(sched::one_f_one_b{}, 4, 6, none) != a);      // micro-batches
    CHECK(plans.get(sched::one_f_one_b{}, 4, 8, all) != a);       // checkpointed
    CHECK(plans.get(sched::zero_bubble_h1{}, 4, 8, none) != a);   // schedule type
    const sched::OffloadCosts costs{.round_trips = 0.0};
    const auto off = plans.get(sched::one_f_one_b{}, 4, 8, all, &costs);
    CHECK(*off == sched::offload(sched::plan(sched::one_f_one_b{}, 4, 8, all), costs));
    const sched::OffloadCosts other{.round_trips = 3.0};
    CHECK(plans.get(sched::one_f_one_b{}, 4, 8, all, &other) != off);  // offload costs
    CHECK(plans.get(sched::one_f_one_b{}, 4, 8, all, &costs) == off);
    CHECK(plans.misses() == 6);
  }

  TEST_CASE("schedules with parameters are told apart by value") {
    sched::PlanCache plans;
    const std::vector<int> none(8, 0);
    const auto two = plans.get(sched::interleaved_one_f_one_b{2}, 8, 8, none);
    const auto four = plans.get(sched::interleaved_one_f_one_b{4}, 8, 8, none);
    CHECK(two != four);
    CHECK(two->workers == 4);
    CHECK(four->workers == 2);
    CHECK(plans.get(sched::interleaved_one_f_one_b{2}, 8, 8, none) == two);
  }

  TEST_CASE("any_schedule: copies share a plan, schedules made apart do not") {
    sched::PlanCache plans;
    const std::vector<int> none(4, 0);
    const sched::any_schedule s("1f1b", sched::one_f_one_b{});
    const sched::any_schedule copy = s;
    const auto a = plans.get(s, 4, 8, none);
    CHECK(plans.get(copy, 4, 8, none) == a);
    CHECK(plans.get(sched::any_schedule("1f1b", sched::zero_bubble_h1{}), 4, 8, none) != a);
  }

  TEST_CASE("a schedule that cannot be compared is planned on every call") {
    sched::PlanCache plans;
    const std::vector<int> none(2, 0);
    const auto a = plans.get(named_1f1b{}, 2, 4, none);
    const auto b = plans.get(named_1f1b{}, 2, 4, none);
    CHECK(a != b);
    CHECK(*a == *b);
    CHECK(plans.misses() == 2);
    CHECK(plans.size() == 0);
  }

  TEST_CASE("at most capacity plans are kept, the least recently used dropped first") {
    sched::PlanCache plans(2);
    const std::vector<int> none(2, 0);
    const auto m2 = plans.get(sched::one_f_one_b{}, 2, 2, none);
    const auto m3 = plans.get(sched::one_f_one_b{}, 2, 3, none);
    CHECK(plans.get(sched::one_f_one_b{}, 2, 2, none) == m2);  // now the most recent
    (void)plans.get(sched::one_f_one_b{}, 2, 4, none);          // drops m3
    CHECK(plans.size() == 2);
    CHECK(plans.get(sched::one_f_one_b{}, 2, 2, none) == m2);
    CHECK(plans.get(sched::one_f_one_b{}, 2, 3, none) != m3);
  }
}
