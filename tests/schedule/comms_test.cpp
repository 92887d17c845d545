#include "stagewise/schedule/comms.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
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
using sched::Action;
using sched::ActionKind;
using sched::SkipRoute;
using sched::Transfer;
using sched::TransferKind;
using stagewise::testing::contains;
using stagewise::testing::error_of;

namespace {

Action F(int micro, int stage) {
  return {stage, ActionKind::forward, micro};
}
Action B(int micro, int stage) {
  return {stage, ActionKind::backward, micro};
}

// Every built-in schedule, as (name, plan for `stages` stages and `m` micro-batches).
template <class Check>
void for_each_schedule(int stages, int m, int checkpointed, Check check) {
  check("gpipe", sched::plan(sched::gpipe{}, stages, m, checkpointed));
  check("1f1b", sched::plan(sched::one_f_one_b{}, stages, m, checkpointed));
  check("zb-h1", sched::plan(sched::zero_bubble_h1{}, stages, m, checkpointed));
  if (stages % 2 == 0) {
    check("interleaved{2}",
          sched::plan(sched::interleaved_one_f_one_b{2}, stages, m, checkpointed));
    check("looped_bfs{2}", sched::plan(sched::looped_bfs{2}, stages, m, checkpointed));
    check("zb-v", sched::plan(sched::zero_bubble_v{}, stages, m, checkpointed));
    check("v-half", sched::plan(sched::v_half{}, stages, m, checkpointed));
    check("v-min", sched::plan(sched::v_min{}, stages, m, checkpointed));
    if (m >= stages) check("dualpipe-v", sched::plan(sched::dualpipe_v{}, stages, m, checkpointed));
  }
}

std::string steps(const sched::CommPlan& c, int worker) {
  std::string out;
  for (const auto& s : c.programs[static_cast<std::size_t>(worker)]) {
    out += (out.empty() ? "" : " ") + std::string(s.send ? "send " : "recv ") +
           static_cast<char>(s.transfer.kind) + std::to_string(s.transfer.micro) + ":" +
           std::to_string(s.transfer.from) + ">" + std::to_string(s.transfer.to) + "@" +
           sched::to_string(s.action);
  }
  return out;
}

}  // namespace

TEST_SUITE("comms") {
  TEST_CASE("1F1B on two stages: worker 1 receives each activation at F and sends the gradient") {
    const auto c = sched::comms(sched::plan(sched::one_f_one_b{}, 2, 2));
    CHECK(steps(c, 0) == "send a0:0>1@F0@0 send a1:0>1@F1@0 recv g0:1>0@B0@0 recv g1:1>0@B1@0");
    CHECK(steps(c, 1) == "recv a0:0>1@F0@1 send g0:1>0@B0@1 recv a1:0>1@F1@1 send g1:1>0@B1@1");
  }

  TEST_CASE("a skip is sent at the stash stage's F and its gradient comes back at the pop's B") {
    const auto c = sched::comms(sched::plan(sched::gpipe{}, 3, 1), {SkipRoute{0, 2}});
    CHECK(steps(c, 0) == "send a0:0>1@F0@0 send s0:0>2@F0@0 recv g0:1>0@B0@0 recv k0:2>0@B0@0");
    CHECK(steps(c, 2) == "recv a0:1>2@F0@2 recv s0:0>2@F0@2 send g0:2>1@B0@2 send k0:2>0@B0@2");
    CHECK(c.programs[0][1].transfer == Transfer{TransferKind::skip, 0, 2, 0, 0});
  }

  TEST_CASE("V-shaped placement: stage 3 of 4 runs on worker 0, next to stage 0") {
    const auto c = sched::comms(sched::plan(sched::zero_bubble_v{}, 4, 2));
    CHECK(c.worker_of(0) == 0);
    CHECK(c.worker_of(1) == 1);
    CHECK(c.worker_of(2) == 1);
    CHECK(c.worker_of(3) == 0);
    CHECK(contains(steps(c, 0), "recv a0:2>3@F0@3"));  // worker 0 runs stage 3
    CHECK(contains(steps(c, 1), "send a0:2>3@F0@2"));  // from stage 2 on worker 1
    CHECK(contains(steps(c, 1), "send a0:1>2@F0@1"));  // stages 1 and 2 on one worker
  }

  TEST_CASE("a skip popped on its own stage and R and W actions communicate nothing") {
    const auto p = sched::plan(sched::zero_bubble_h1{}, 1, 2, /*checkpointed=*/2);
    CHECK(sched::comms(p, {SkipRoute{0, 0}}).programs[0].empty());
  }

  TEST_CASE(
      "every built-in schedule's messages match and cannot deadlock, with and without skips") {
    for (int stages : {1, 2, 4}) {
      for (int m : {1, 3, 4, 8}) {
        for (int checkpointed : {0, m}) {
          for_each_schedule(stages, m, checkpointed, [&](const char* name, const sched::Plan& p) {
            CAPTURE(name);
            CAPTURE(stages);
            CAPTURE(m);
            CHECK(sched::check_comms(p) == std::nullopt);
            std::vector<SkipRoute> routes{{0, stages - 1}, {0, stages / 2}};
            if (stages > 2) routes.push_back({1, 2});
            CHECK(sched::check_comms(p, routes) == std::nullopt);
            CHECK_NOTHROW(sched::verify_comms(p, routes));
          });
        }
      }
    }
  }

  TEST_CASE("a worker that waits for a gradient before sending the activation is a deadlock") {
    sched::Plan p{2, 1, 2, {{B(0, 0), F(0, 0)}, {F(0, 1), B(0, 1)}}, {}};
    const auto e = error_of([&] { sched::verify_comms(p); });
    CHECK(e ==
          "stagewise::schedule::verify_comms: deadlock at B0@0 on worker 0: no worker can go on "
          "(worker 0 waits at B0@0 for the gradient of micro-batch 0 from stage 1 to stage 0, "
          "sent at B0@1; worker 1 waits at F0@1 for the activation of micro-batch 0 from stage 0 "
          "to stage 1, sent at F0@0). Order each worker's actions so that every message is sent "
          "before a worker waits for it");
  }

  TEST_CASE("messages received in another order than sent on one link are named") {
    sched::Plan p{
        2, 2, 2, {{F(0, 0), F(1, 0), B(0, 0), B(1, 0)}, {F(1, 1), F(0, 1), B(0, 1), B(1, 1)}}, {}};
    CHECK(sched::check_comms(p) ==
          "on the link of activations from stage 0 to stage 1, message #0 is micro-batch 0 (sent "
          "at F0@0 on worker 0) but F1@1 on worker 1 receives micro-batch 1 there; order the "
          "receiving stage's actions like the sending stage's");
  }

  TEST_CASE("a send nobody receives and a receive nobody sends are named") {
    sched::Plan lost{2, 1, 2, {{F(0, 0), B(0, 0)}, {}}, {}};
    CHECK(sched::check_comms(lost) ==
          "F0@0 on worker 0 sends the activation of micro-batch 0 from stage 0 to stage 1, which "
          "no action receives; the receiving stage's F (activations, skips) or B/I (gradients) "
          "must be in the plan");
    sched::Plan orphan{2, 1, 2, {{}, {F(0, 1)}}, {}};
    CHECK(sched::check_comms(orphan) ==
          "F0@1 on worker 1 receives the activation of micro-batch 0 from stage 0 to stage 1, "
          "which no action sends; the sending stage's F (activations, skips) or B/I (gradients) "
          "must be in the plan");
  }

  TEST_CASE("a skip route backwards or outside the pipeline is named") {
    const auto p = sched::plan(sched::gpipe{}, 2, 1);
    CHECK(sched::check_comms(p, {SkipRoute{1, 0}}) ==
          "skip route 0 goes from stage 1 to stage 0; a skip is popped on its stash stage or a "
          "later one, within stages 0..1");
    CHECK(contains(error_of([&] {
                     sched::verify_comms(p, {SkipRoute{0, 2}});
                   }),
                   "skip route 0 goes from stage 0 to stage 2"));
  }

  TEST_CASE("a deadlock through a worker waiting on its own later message is found") {
    // Interleaved placement: stages 0 and 2 on worker 0; worker 0 runs F0@2 before F0@0.
    sched::Plan p{
        4, 1, 2, {{F(0, 2), F(0, 0), B(0, 2), B(0, 0)}, {F(0, 1), F(0, 3), B(0, 3), B(0, 1)}}, {}};
    CHECK(contains(sched::check_comms(p).value_or(""), "deadlock at F0@2 on worker 0"));
  }
}
