// plan_memory: the fastest checkpoint mode and offload choice whose predicted peak fits a budget,
// and the refusal naming the smallest budget that would.
#include "stagewise/schedule/memory_plan.hpp"
#include "stagewise/schedule/any_schedule.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

const sched::any_schedule gpipe("gpipe", sched::gpipe{});
// Four stages whose micro-batch keeps 100 bytes of activations, or 10 of input when checkpointed.
const std::vector<sched::StageMemory> stages(4, {.activations = 100, .kept = 10});

double worst(const sched::MemoryPlan& p) {
  double w = 0;
  for (double b : p.predicted_peak) w = std::max(w, b);
  return w;
}

}  // namespace

TEST_SUITE("memory plan") {
  TEST_CASE("a large budget keeps everything: no checkpointing, no offload") {
    const auto p = sched::plan_memory(gpipe, 8, stages, 1 << 20);
    CHECK(p.checkpoint == sw::Checkpoint::never);
    CHECK_FALSE(p.offload);
    CHECK(worst(p) == doctest::Approx(8 * 100 + 100));  // 8 cells, and a backward's working
  }

  TEST_CASE("tighter budgets checkpoint, then offload; each plan fits its budget") {
    const auto never = sched::plan_memory(gpipe, 8, stages, 1 << 20);
    double last_time = never.step_time;
    for (std::int64_t budget : {800, 400, 280}) {
      CAPTURE(budget);
      const auto p = sched::plan_memory(gpipe, 8, stages, budget);
      CHECK(worst(p) <= budget);
      CHECK(p.checkpoint != sw::Checkpoint::never);
      CHECK(p.step_time >= last_time);
      last_time = p.step_time;
    }
    // Always checkpointed, a stage holds its 8 inputs, one recomputed cell and its backward's
    // working memory; below that only offload fits, on stages 1..3 (stage 0's inputs stay: here
    // they cost nothing).
    const auto p = sched::plan_memory(gpipe, 8, {{100, 0}, {100, 10}, {100, 10}, {100, 10}}, 215);
    CHECK(p.checkpoint != sw::Checkpoint::never);  // except_last with offload is the fastest fit
    CHECK(p.offload);
    CHECK_FALSE(p.offloaded.empty());
    for (auto c : p.offloaded) CHECK(c.stage > 0);
    CHECK(worst(p) <= 215);
    const std::string text = p.to_string();
    const std::string mode = sw::to_string(p.checkpoint);
    CHECK(contains(text,
                   "memory plan for gpipe, 8 micro-batches, budget 215 bytes per stage: "
                   "checkpoint " +
                       mode + ", offload"));
    CHECK(contains(text, "  stage 1: checkpoint " + mode + ", offloads "));
    CHECK(contains(text, "  considered: never: step "));
  }

  TEST_CASE("a budget nothing fits is refused with the smallest that would") {
    const auto e = error_of([] { (void)sched::plan_memory(gpipe, 8, stages, 100); });
    CHECK(contains(e,
                   "stagewise::PipeOptions().memory_budget: no plan of gpipe with 8 "
                   "micro-batches fits 100 bytes of activations per stage; the smallest "
                   "budget that fits is "));
    // The number it names fits.
    const auto at = e.find("fits is ") + 8;
    const auto smallest = std::stoll(e.substr(at));
    CHECK(smallest > 100);
    CHECK_NOTHROW((void)sched::plan_memory(gpipe, 8, stages, smallest));
    CHECK(contains(error_of([] { (void)sched::plan_memory(gpipe, 8, stages, 100, false); }),
                   "or a store to offload to"));
    CHECK(contains(error_of([] { (void)sched::plan_memory(gpipe, 8, stages, 0); }),
                   "the budget is 0 bytes; give a positive number"));
  }

  TEST_CASE("1F1B holds fewer micro-batches, so it fits where GPipe needs checkpointing") {
    const sched::any_schedule ofob("one_f_one_b", sched::one_f_one_b{});
    const auto p = sched::plan_memory(ofob, 8, stages, 4 * 100 + 100);
    CHECK(p.checkpoint == sw::Checkpoint::never);
    CHECK(sched::plan_memory(gpipe, 8, stages, 4 * 100 + 100).checkpoint != sw::Checkpoint::never);
  }
}
