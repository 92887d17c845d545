// plan_memory: the fastest checkpoint mode and offload choice whose predicted peak fits a budget,
// and the refusal naming the smallest budget that would.
#include "stagewise/plan/memory_plan.hpp"
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

bool all_never(const sched::MemoryPlan& p) {
  for (auto mode : p.checkpoints) {
    if (mode != sw::Checkpoint::never) return false;
  }
  return !p.checkpoints.empty();
}

double worst(const sched::MemoryPlan& p) {
  double w = 0;
  for (double b : p.predicted_peak) w = std::max(w, b);
  return w;
}

}  // namespace

TEST_SUITE("memory plan") {
  TEST_CASE("a large budget keeps everything: no checkpointing, no offload") {
    const auto p = sched::plan_memory(gpipe, 8, stages, 1 << 20);
    CHECK(all_never(p));
    CHECK(p.checkpoints.size() == 4);
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
      CHECK_FALSE(all_never(p));
      CHECK(p.step_time >= last_time);
      last_time = p.step_time;
    }
    // Always checkpointed, a stage holds its 8 inputs, one recomputed cell and its backward's
    // working memory; below that only offload fits, on stages 1..3 (stage 0's inputs stay: here
    // they cost nothing).
    const auto p = sched::plan_memory(gpipe, 8, {{100, 0}, {100, 10}, {100, 10}, {100, 10}}, 215);
    CHECK(p.checkpoints[1] != sw::Checkpoint::never);  // checkpointed and offloaded
    CHECK(p.offload);
    CHECK(p.offload_stages[1]);
    CHECK_FALSE(p.offload_stages[0]);
    CHECK_FALSE(p.offloaded.empty());
    for (auto c : p.offloaded) CHECK(c.stage > 0);
    CHECK(worst(p) <= 215);
    const std::string text = p.to_string();
    const std::string mode = sw::to_string(p.checkpoints[1]);
    CHECK(contains(text,
                   "memory plan for gpipe, 8 micro-batches, budget 215 bytes per stage: "
                   "offload, step "));
    CHECK(contains(text, "  stage 1: checkpoint " + mode + ", offloads "));
    CHECK(contains(text, " micro-batches, predicted peak "));
    CHECK(contains(text, "  considered: never | never | never | never: step "));
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
    CHECK(all_never(p));
    CHECK_FALSE(all_never(sched::plan_memory(gpipe, 8, stages, 4 * 100 + 100)));
  }

  TEST_CASE("each stage gets its own mode: 1F1B's later stages hold less and keep theirs") {
    // 1F1B: stage j holds 4 - j micro-batches (and a backward's working memory): 500, 400, 300,
    // 200 bytes. With 300, stages 0 and 1 must checkpoint; stages 2 and 3 fit as they are.
    const sched::any_schedule ofob("one_f_one_b", sched::one_f_one_b{});
    const auto p = sched::plan_memory(ofob, 8, stages, 300, false);
    REQUIRE(p.checkpoints.size() == 4);
    CHECK(p.checkpoints[0] != sw::Checkpoint::never);
    CHECK(p.checkpoints[1] != sw::Checkpoint::never);
    CHECK(p.checkpoints[2] == sw::Checkpoint::never);
    CHECK(p.checkpoints[3] == sw::Checkpoint::never);
    CHECK(worst(p) <= 300);
    // Faster than the same mode on every stage, which recomputes on every stage.
    double uniform = 0;
    for (const auto& line : p.considered) {
      const std::string prefix = "except_last | except_last | except_last | except_last: step ";
      if (line.rfind(prefix, 0) == 0) uniform = std::stod(line.substr(prefix.size()));
    }
    REQUIRE(uniform > 0);
    CHECK(p.step_time < uniform);
    CHECK(contains(p.to_string(), "  stage 3: checkpoint never, offloads 0 of 8 micro-batches"));
  }
}
