// The schedules of issue 13 run on the pipe: looped BFS, ZB-V and DualPipeV (V-shaped
// placement), a schedule read from PyTorch's CSV, and recomputes placed by the schedule; each
// gives the loss and gradients of unpipelined training on the same micro-batches, bit for bit.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/choose.hpp"
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <string>
#include <typeinfo>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::check_equal_to_reference;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::grads_of;
using sw::testing::mlp;
using sw::testing::mse;
using sw::testing::reference_step;

namespace {

// 1F1B that recomputes micro-batch i early, right after the forward of micro-batch i + 1 where
// its backward has not run yet; plan places the other recomputes.
struct early_recompute {
  sw::coro::generator<sched::Action> operator()(int stages, int micro_batches) const {
    std::vector<char> done(static_cast<std::size_t>(stages * micro_batches), 0);
    for (const auto& a : sched::one_f_one_b{}(stages, micro_batches)) {
      co_yield a;
      const auto cell = static_cast<std::size_t>(a.stage * micro_batches + a.micro);
      if (a.kind == sched::ActionKind::backward) done[cell] = 1;
      if (a.kind == sched::ActionKind::forward && a.micro > 0 && !done[cell - 1]) {
        co_yield sched::Action{a.stage, sched::ActionKind::recompute, a.micro - 1};
      }
    }
  }
};

}  // namespace

TEST_SUITE("train_step: V-shaped, looped and CSV schedules") {
  TEST_CASE("looped BFS's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::looped_bfs{2}, sw::balance{2, 2, 2, 2}, false);
    check_equal_to_reference(sched::looped_bfs{4}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, false);
  }

  TEST_CASE("ZB-V's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::zero_bubble_v{}, sw::balance{2, 2, 2, 2}, true);
    check_equal_to_reference(sched::zero_bubble_v{}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
    check_equal_to_reference(sched::zero_bubble_v{}, sw::balance{3, 5}, true, 0.5);
  }

  TEST_CASE("V-Half's and V-Min's gradients equal unpipelined training in every checkpoint mode") {
    for (const auto& b : {sw::balance{2, 2, 2, 2}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}}) {
      check_equal_to_reference(sched::v_half{}, b, true);
      check_equal_to_reference(sched::v_min{}, b, true);
    }
    check_equal_to_reference(sched::v_min{}, sw::balance{3, 5}, true, 0.5);
  }

  TEST_CASE("V-Half and V-Min with the optimizer fused into backward equal the unfused step") {
    // 3 steps of Adam on 8 stages (4 workers): fused into the V schedule's W passes, and
    // train_step under the same schedule followed by the unfused optimizer.
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::always}) {
      for (int which = 0; which < 2; ++which) {
        CAPTURE(which);
        torch::manual_seed(3);
        auto fused_model = mlp();
        torch::manual_seed(3);
        auto plain_model = mlp();
        const sw::balance b{1, 1, 1, 1, 1, 1, 1, 1};
        auto fused_pipe = sw::Pipe(fused_model, b, sw::PipeOptions().chunks(4).checkpoint(mode));
        auto plain_pipe = sw::Pipe(plain_model, b, sw::PipeOptions().chunks(4).checkpoint(mode));
        const auto adam = torch::optim::AdamOptions(0.01);
        sw::optim::FusedStep fused(fused_pipe->parameters(), adam);
        torch::optim::Adam plain(plain_pipe->parameters(), adam);
        for (int step = 0; step < 3; ++step) {
          auto x = torch::randn({8, 6});
          auto t = torch::randn({8, 3});
          torch::Tensor a, c;
          plain.zero_grad();
          if (which == 0) {
            a = fused_pipe->train_step(x, t, mse, fused, sched::v_half{});
            c = plain_pipe->train_step(x, t, mse, sched::v_half{});
          } else {
            a = fused_pipe->train_step(x, t, mse, fused, sched::v_min{});
            c = plain_pipe->train_step(x, t, mse, sched::v_min{});
          }
          plain.step();
          CHECK(a.item<float>() == c.item<float>());
        }
        auto pf = fused_model->parameters();
        auto pp = plain_model->parameters();
        for (std::size_t k = 0; k < pf.size(); ++k) CHECK(pf[k].equal(pp[k]));
      }
    }
  }

  TEST_CASE("the pipe takes schedule::choose's answer: its stages and its any_schedule") {
    // 4 workers, 4 micro-batches: the fastest is ZB-V; a limit of 2 micro-batches per worker
    // leaves V-Min.
    for (double limit : {100.0, 2.0}) {
      const auto c =
          sched::choose(4, 4, {}, sched::ActivationLimit::micro_batches(limit),
                        {{sched::any_schedule("one_f_one_b", sched::one_f_one_b{}), 1},
                         {sched::any_schedule("zero_bubble_v", sched::zero_bubble_v{}), 2},
                         {sched::any_schedule("v_min", sched::v_min{}), 2}});
      CAPTURE(limit);
      CHECK(c.stages == 8);
      CHECK(c.schedule.name() == (limit > 2 ? "zero_bubble_v" : "v_min"));
      check_equal_to_reference(c.schedule, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
    }
  }

  TEST_CASE("DualPipeV's gradients equal unpipelined training in every checkpoint mode") {
    check_equal_to_reference(sched::dualpipe_v{}, sw::balance{2, 2, 2, 2}, true);
    check_equal_to_reference(sched::dualpipe_v{}, sw::balance{3, 5}, true, 0.5);
  }

  TEST_CASE("a ZB-V step runs stages w and 2K-1-w on worker w, as the plan says") {
    torch::manual_seed(3);
    auto seq = mlp();
    auto pipe =
        sw::Pipe(seq, sw::balance{2, 2, 2, 2}, sw::PipeOptions().chunks(4).checkpoint("never"));
    sched::Timeline t;
    pipe->train_step(torch::randn({8, 6}), torch::randn({8, 3}), mse, sched::zero_bubble_v{}, &t);
    CHECK(t.workers == 2);
    CHECK(t.actions.size() == 3 * 4 * 4);
    for (const auto& a : t.actions)
      CHECK(a.worker == (a.action.stage < 2 ? a.action.stage : 3 - a.action.stage));
  }

  TEST_CASE("a schedule read from PyTorch's CSV trains like the schedule it was written from") {
    const auto text = sched::to_csv(sched::plan(sched::zero_bubble_v{}, 4, 4));
    check_equal_to_reference(sched::from_csv(text), sw::balance{2, 2, 2, 2}, true);
    // 1F1B as PyTorch prints it for 2 ranks and 4 micro-batches.
    const auto one_f_one_b =
        sched::from_csv("0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n");
    check_equal_to_reference(one_f_one_b, sw::balance{3, 5}, true);
    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(2));
    CHECK(contains(error_of([&] {
                     pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, one_f_one_b);
                   }),
                   "the CSV schedule is for 2 stages and 4 micro-batches, asked for 2 and 2"));
  }

  TEST_CASE("recomputes placed by the schedule give the same gradients") {
    const std::vector<sw::Checkpoint> modes{sw::Checkpoint::except_last, sw::Checkpoint::always};
    check_equal_to_reference(early_recompute{}, sw::balance{3, 2, 3}, true, 0.0, modes);
    check_equal_to_reference(early_recompute{}, sw::balance{3, 5}, true, 0.5, modes);
    // Without checkpointing there is nothing to recompute: the schedule's R is refused.
    auto seq = mlp();
    auto pipe = sw::Pipe(seq, sw::balance{3, 5}, sw::PipeOptions().chunks(2).checkpoint("never"));
    CHECK(contains(
        error_of([&] {
          pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, early_recompute{});
        }),
        "R0@0 (action #2) recomputes micro-batch 0, which is not checkpointed (no "
        "micro-batch is on stage 0)"));
  }
}
