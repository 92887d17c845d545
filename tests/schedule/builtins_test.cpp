// schedule/builtins.hpp: the one list of built-in schedules, each naming itself; what `choose`,
// `builtin_schedule` and tools/schedule_svg read from it; a named schedule of one's own.
#include "stagewise/schedule/builtins.hpp"
#include "stagewise/schedule/choose.hpp"
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/simulate.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using stagewise::testing::error_of;

namespace {

// A schedule of one's own that names itself: GPipe's forwards, then each stage's backwards in
// micro-batch order. Not in the list.
struct forwards_then_ascending {
  static constexpr std::string_view name = "forwards_then_ascending";
  stagewise::coro::generator<sched::Action> operator()(int stages, int micro_batches) const {
    for (int s = 0; s < stages; ++s) {
      for (int i = 0; i < micro_batches; ++i) co_yield {s, sched::ActionKind::forward, i};
      for (int i = 0; i < micro_batches; ++i) co_yield {s, sched::ActionKind::backward, i};
    }
  }
};

struct unnamed {
  stagewise::coro::generator<sched::Action> operator()(int, int) const { co_return; }
};

}  // namespace

static_assert(sched::named_schedule<sched::gpipe>);
static_assert(sched::named_schedule<sched::interleaved_one_f_one_b>);
static_assert(sched::named_schedule<sched::v_min>);
static_assert(sched::named_schedule<sched::csv_schedule>);
static_assert(sched::named_schedule<forwards_then_ascending>);
static_assert(!sched::named_schedule<unnamed>);
static_assert(!sched::named_schedule<sched::any_schedule>);

TEST_SUITE("builtins") {
  TEST_CASE("every built-in names itself, once, and runs the stages per worker it says") {
    // Read from the list, so that a new schedule needs no line here.
    const auto names = sched::builtin_names();
    CHECK(names.size() >= 9);
    CHECK(std::set<std::string>(names.begin(), names.end()).size() == names.size());
    std::size_t k = 0;
    sched::for_each_schedule([&](auto s) {
      CAPTURE(s.name);
      CHECK(names[k++] == s.name);
      CHECK(!sched::title_of(s).empty());
      for (const char c : s.name)
        CHECK(((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'));
      // 4 workers run 4 x its stages per worker.
      const int n = 4 * sched::stages_per_worker_of(s);
      CHECK(sched::workers_of(s, n) == 4);
      const int m = std::max(8, sched::min_micro_batches_of(s, 4));
      CHECK(sched::plan(sched::builtin_schedule(s.name), n, m).programs ==
            sched::plan(s, n, m).programs);
    });
    CHECK(names.front() == "gpipe");
    CHECK(sched::title_of(sched::v_min{}) == "V-Min");
    CHECK(sched::title_of(sched::interleaved_one_f_one_b{}) == "interleaved 1F1B");
    CHECK(sched::stages_per_worker_of(sched::zero_bubble_v{}) == 2);
    CHECK(sched::stages_per_worker_of(sched::looped_bfs{3}) == 3);
    CHECK(sched::stages_per_worker_of(forwards_then_ascending{}) == 1);
    CHECK(sched::min_micro_batches_of(sched::dualpipe_v{}, 4) == 8);
    CHECK(sched::min_micro_batches_of(sched::one_f_one_b{}, 4) == 1);
  }

  TEST_CASE("a schedule's name is its type's; those with virtual stages add them") {
    CHECK(sched::name_of(sched::zero_bubble_h1{}) == "zero_bubble_h1");
    CHECK(sched::name_of(sched::interleaved_one_f_one_b{3}) == "interleaved_one_f_one_b{3}");
    CHECK(sched::any_schedule(sched::looped_bfs{2}).name() == "looped_bfs{2}");
    CHECK(sched::any_schedule(sched::v_min{}).name() == "v_min");
    CHECK(sched::any_schedule("mine", sched::v_min{}).name() == "mine");
    CHECK(sched::name_of(sched::any_schedule("mine", sched::v_min{})) == "mine");
    CHECK(sched::any_schedule(sched::from_csv("0F0,0B0\n")).name() == "csv");
  }

  TEST_CASE("choose weighs the list's schedules in its order, but those that opt out") {
    std::vector<std::string> expected;
    sched::for_each_schedule([&](auto s) {
      if (sched::default_candidate(s)) expected.push_back(sched::name_of(s));
    });
    CHECK(!sched::default_candidate(sched::looped_bfs{}));
    std::vector<std::string> names;
    for (const auto& c : sched::default_candidates()) {
      names.push_back(c.schedule.name());
    }
    CHECK(names == expected);
    CHECK(names[3] == "interleaved_one_f_one_b{2}");
    CHECK(sched::default_candidates()[3].stages_per_worker == 2);
  }

  TEST_CASE("builtin_schedule finds a built-in by name, and names them all when none is") {
    const auto v = sched::builtin_schedule("v_half");
    CHECK(v.name() == "v_half");
    CHECK(sched::plan(v, 8, 8).programs == sched::plan(sched::v_half{}, 8, 8).programs);
    const auto i = sched::builtin_schedule("interleaved_one_f_one_b", 4);
    CHECK(i.name() == "interleaved_one_f_one_b{4}");
    CHECK(i.workers(8) == 2);
    std::string all;
    for (const auto& n : sched::builtin_names()) all += (all.empty() ? "" : ", ") + n;
    CHECK(all.rfind("gpipe, one_f_one_b, zero_bubble_h1, interleaved_one_f_one_b, looped_bfs, "
                    "zero_bubble_v, dualpipe_v, v_half, v_min",
                    0) == 0);
    CHECK(error_of([] { sched::builtin_schedule("pipedream"); }) ==
          "stagewise::schedule::builtin_schedule: no built-in schedule is named 'pipedream'; the "
          "built-ins are " +
              all);
  }

  TEST_CASE("a named schedule of one's own runs through any_schedule, simulate and choose") {
    const sched::any_schedule mine(forwards_then_ascending{});
    CHECK(mine.name() == "forwards_then_ascending");
    // GPipe's makespan: every forward cycle, then every backward one: (M + K - 1)(T_F + T_I + T_W).
    CHECK(sched::simulate(mine, 3, 4).makespan() == 6.0 * 3);
    auto candidates = sched::default_candidates();
    candidates.push_back(sched::ScheduleCandidate::of(forwards_then_ascending{}));
    const auto c = sched::choose(3, 4, {}, sched::ActivationLimit::none(), candidates);
    std::set<std::string> seen;
    for (const auto& e : c.all) seen.insert(e.name);
    CHECK(seen.count("forwards_then_ascending") == 1);
    CHECK(seen.size() == sched::default_candidates().size() + 1);
  }
}
