// PipeOptions().checkpoint({...}): one checkpoint mode per stage. Each stage recomputes exactly
// the micro-batches its own mode checkpoints, the result equals unpipelined training bit for bit
// (dropout replayed, skips, every schedule, forward() and train_step), and a list of the wrong
// length is refused at construction.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/listed_schedule.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::Checkpoint;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::grads_of;
using sw::testing::mse;

namespace {

const std::vector<Checkpoint> kModes = {Checkpoint::always, Checkpoint::never,
                                        Checkpoint::except_last};

// One step of mlp(0.5) in 3 stages with `modes` under `s`, against the unpipelined step.
template <class Schedule>
void check_step(const Schedule& s, bool ascending, const std::vector<Checkpoint>& modes) {
  torch::manual_seed(3);
  auto seq = sw::testing::mlp(0.5);
  auto x = torch::randn({10, 6});
  auto t = torch::randn({10, 3});
  torch::manual_seed(5);
  const auto expected_loss = sw::testing::reference_step(*seq, x, t, 4, ascending);
  const auto expected = grads_of(*seq);
  seq->zero_grad();
  auto pipe = sw::Pipe(seq, sw::balance{3, 2, 3}, sw::PipeOptions().chunks(4).checkpoint(modes));
  torch::manual_seed(5);
  sched::Timeline timeline;
  const torch::Tensor loss = pipe->train_step(x, t, mse, s, &timeline);
  CHECK(loss.item<float>() == expected_loss.item<float>());
  const auto got = grads_of(*seq);
  REQUIRE(got.size() == expected.size());
  for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
  // Each stage recomputed what its own mode checkpoints: always 4, except_last 3, never 0.
  std::vector<int> recomputes(modes.size(), 0);
  for (const auto& e : timeline.actions) {
    if (e.action.kind == sched::ActionKind::recompute) ++recomputes[e.action.stage];
  }
  for (std::size_t j = 0; j < modes.size(); ++j) {
    CAPTURE(j);
    CHECK(recomputes[j] == sw::checkpoint_stop(modes[j], 4, true));
  }
}

}  // namespace

TEST_SUITE("checkpoint per stage") {
  TEST_CASE("each stage recomputes what its mode checkpoints, equal to unpipelined training") {
    check_step(sched::gpipe{}, false, kModes);
    check_step(sched::one_f_one_b{}, true, kModes);
    check_step(sched::zero_bubble_h1{}, true, {Checkpoint::except_last, Checkpoint::always,
                                               Checkpoint::never});
  }

  TEST_CASE("forward() checkpoints per stage and equals the whole model's gradients") {
    torch::manual_seed(3);
    auto seq = sw::testing::mlp();
    auto x = torch::randn({10, 6});
    auto t = torch::randn({10, 3});
    mse(seq->forward(x), t).backward();
    const auto expected = grads_of(*seq);
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, sw::balance{3, 2, 3}, sw::PipeOptions().chunks(4).checkpoint(kModes));
    mse(pipe->forward(x), t).backward();
    const auto got = grads_of(*seq);
    for (std::size_t k = 0; k < got.size(); ++k) {
      CHECK(torch::allclose(got[k], expected[k], 1e-6, 1e-7));
    }
  }

  TEST_CASE("options: the list replaces one mode, one mode replaces the list; reads per stage") {
    auto o = sw::PipeOptions().checkpoint(kModes);
    CHECK(o.checkpoint_of(0) == Checkpoint::always);
    CHECK(o.checkpoint_of(1) == Checkpoint::never);
    CHECK((o.checkpoints(3) == kModes));
    CHECK(contains(error_of([&] { (void)o.checkpoint(); }),
                   "stagewise::PipeOptions::checkpoint(): the stages have different modes; read "
                   "each with checkpoint_of(stage)"));
    o.checkpoint(Checkpoint::never);
    CHECK(o.checkpoint() == Checkpoint::never);
    CHECK((o.checkpoints(2) == std::vector<Checkpoint>{Checkpoint::never, Checkpoint::never}));
    CHECK(sw::PipeOptions().checkpoint({Checkpoint::always, Checkpoint::always}).checkpoint() ==
          Checkpoint::always);
    CHECK(contains(error_of([] { sw::PipeOptions().checkpoint(std::vector<Checkpoint>{}); }),
                   "stagewise::PipeOptions: checkpoint got an empty list of modes; give one mode "
                   "per stage, or one mode for all"));
  }

  TEST_CASE("a list of modes for another number of stages is refused at construction") {
    const auto e = error_of([] {
      (void)sw::Pipe(sw::testing::mlp(), sw::balance{4, 4},
                     sw::PipeOptions().checkpoint(kModes));
    });
    CHECK(contains(e,
                   "stagewise::PipeOptions: checkpoint gives 3 modes for a pipe of 2 stages; give "
                   "one mode per stage, or one mode for all"));
  }

  TEST_CASE("the plan recomputes per stage, and an R on a stage that keeps its cells is refused") {
    const auto p = sched::plan(sched::one_f_one_b{}, 2, 4, {3, 0});
    int r0 = 0, r1 = 0;
    for (const auto& a : p.programs[0]) r0 += a.kind == sched::ActionKind::recompute;
    for (const auto& a : p.programs[1]) r1 += a.kind == sched::ActionKind::recompute;
    CHECK(r0 == 3);
    CHECK(r1 == 0);
    using namespace sw::testing::actions;
    const sw::testing::listed late_r{
        {F(0, 0), F(0, 1), R(0, 1), B(0, 1), R(0, 0), B(0, 0)}};
    CHECK(contains(error_of([&] { (void)sched::plan(late_r, 2, 1, {1, 0}); }),
                   "recomputes micro-batch 0, which is not checkpointed (no micro-batch is on "
                   "stage 1)"));
    CHECK_NOTHROW((void)sched::plan(late_r, 2, 1, {1, 1}));
    CHECK(contains(error_of([] { (void)sched::plan(sched::one_f_one_b{}, 2, 4, std::vector<int>{3}); }),
                   "stagewise::schedule::plan: 1 checkpointed counts for 2 stages; give one per "
                   "stage"));
  }
}
