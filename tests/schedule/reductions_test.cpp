// Where data-parallel replicas reduce each stage's gradients (schedule/reductions.hpp): after the
// stage's last B or W, in program order; plans that would reduce too early are refused.

#include "stagewise/schedule/reductions.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sched = stagewise::schedule;
using sched::ActionKind;
using stagewise::testing::error_of;

namespace {

// "stage@action" for each of worker w's reduction points, in order.
std::string points(const sched::Plan& p, int w) {
  std::string out;
  const auto all = sched::reductions(p);
  for (const auto& r : all[static_cast<std::size_t>(w)]) {
    CHECK(r.worker == w);
    out += (out.empty() ? "" : " ") + std::to_string(r.stage) + "@" +
           sched::to_string(p.programs[static_cast<std::size_t>(w)][r.after]);
  }
  return out;
}

}  // namespace

TEST_CASE("each stage's reduction point is its last B or W, in program order") {
  // GPipe runs backward from the last micro-batch to the first.
  const auto gpipe = sched::plan(sched::gpipe{}, 2, 3);
  CHECK(points(gpipe, 0) == "0@B0@0");
  CHECK(points(gpipe, 1) == "1@B0@1");
  // Under 1F1B the last stage finishes first; its point is its worker's last action.
  const auto ofob = sched::plan(sched::one_f_one_b{}, 2, 4);
  CHECK(sched::reductions(ofob)[1].front().after == ofob.programs[1].size() - 1);
  // ZB-H1 splits backward: the point is the last W, not the last I.
  const auto zb = sched::plan(sched::zero_bubble_h1{}, 2, 4);
  CHECK(points(zb, 0) == "0@W3@0");
  CHECK(points(zb, 1) == "1@W3@1");
  // Interleaved: worker 0 runs stages 0 and 2 and finishes stage 2's gradients first.
  const auto il = sched::plan(sched::interleaved_one_f_one_b{2}, 4, 4);
  CHECK(points(il, 0) == "2@B3@2 0@B3@0");
  CHECK(points(il, 1) == "3@B3@3 1@B3@1");
  // The V shape: worker 0 runs stages 0 and 3.
  const auto v = sched::plan(sched::zero_bubble_v{}, 4, 4);
  CHECK(points(v, 0) == "3@W3@3 0@W3@0");
}

TEST_CASE("every built-in schedule passes, checkpointed or not") {
  for (int checkpointed : {0, 4}) {
    for (const auto& p : {sched::plan(sched::gpipe{}, 2, 4, checkpointed),
                          sched::plan(sched::one_f_one_b{}, 4, 8, checkpointed),
                          sched::plan(sched::zero_bubble_h1{}, 2, 4, checkpointed),
                          sched::plan(sched::interleaved_one_f_one_b{2}, 4, 4, checkpointed),
                          sched::plan(sched::zero_bubble_v{}, 4, 4, checkpointed),
                          sched::plan(sched::v_half{}, 8, 8, checkpointed),
                          sched::plan(sched::v_min{}, 8, 8, checkpointed)}) {
      CHECK(!sched::check_reductions(p).has_value());
      CHECK_NOTHROW(sched::verify_reductions(p));
      std::size_t n = 0;
      for (const auto& w : sched::reductions(p)) n += w.size();
      CHECK(n == static_cast<std::size_t>(p.stages));
    }
  }
}

TEST_CASE("a plan that would reduce a stage's gradients before they are final is refused") {
  auto missing = sched::plan(sched::gpipe{}, 2, 3);
  missing.programs[0].pop_back();  // B0@0
  CHECK(sched::check_reductions(missing).value() ==
        "stagewise::schedule::check_reductions: stage 0 has 2 weight-gradient actions (B or W) "
        "for 3 micro-batches, so its gradients are never final or counted twice; give every "
        "micro-batch one B, or one I and one W, per stage");
  // verify_reductions checks the messages first: stage 1's gradient of micro-batch 0 is sent to
  // a B that no longer exists.
  CHECK(error_of([&] {
          sched::verify_reductions(missing);
        }).starts_with("stagewise::schedule::verify_comms"));
  // Stage 0's last backward moved to worker 1: neither worker's point has all of them.
  auto split = sched::plan(sched::gpipe{}, 2, 3);
  split.programs[1].push_back(split.programs[0].back());
  split.programs[0].pop_back();
  CHECK(sched::check_reductions(split).value() ==
        "stagewise::schedule::check_reductions: stage 0 computes weight gradients on workers 1 "
        "and 0 (B2@0), so no single point has its gradients final; run each stage's backward on "
        "one worker");
}
