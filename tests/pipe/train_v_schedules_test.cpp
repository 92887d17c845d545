// The schedules of issue 13 run on the pipe: looped BFS, ZB-V and DualPipeV (V-shaped
// placement), a schedule read from PyTorch's CSV, and recomputes placed by the schedule; each
// gives the loss and gradients of unpipelined training on the same micro-batches, bit for bit.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/csv.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <typeinfo>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

torch::nn::Sequential mlp(double dropout = 0.0) {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(),
                               torch::nn::Dropout(dropout), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3));
}

// Unpipelined training on the same micro-batches: every forward, then the backwards in the
// order each stage of the pipe runs them (GPipe: M-1 .. 0; the others 0 .. M-1), so each
// parameter's gradient sums the same terms in the same order and the result is bit for bit equal.
torch::Tensor reference_step(torch::nn::Sequential& seq, const torch::Tensor& x,
                             const torch::Tensor& t, int64_t chunks, bool ascending) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  std::vector<torch::Tensor> losses;
  torch::Tensor total;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double w = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    losses.push_back(mse(seq->forward(xs[i]), ts[i]) * w);
    total = total.defined() ? total + losses.back().detach() : losses.back().detach();
  }
  if (ascending) {
    for (auto& l : losses) l.backward();
  } else {
    for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();
  }
  return total;
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters())
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

// Trains `seq` one step with `sched` in every checkpoint mode and compares with the reference.
template <class Schedule>
void check_equal_to_reference(const Schedule& s, const sw::balance& b, bool ascending,
                              double dropout = 0.0,
                              std::vector<sw::Checkpoint> modes = {sw::Checkpoint::never,
                                                                   sw::Checkpoint::except_last,
                                                                   sw::Checkpoint::always}) {
  for (auto mode : modes) {
    const std::string mode_name = sw::to_string(mode);
    const std::string schedule_name =
        typeid(Schedule).name();  // mangled, enough to tell them apart
    CAPTURE(mode_name);
    CAPTURE(schedule_name);
    torch::manual_seed(3);
    auto seq = mlp(dropout);
    auto x = torch::randn({10, 6});  // 10 rows in 4 chunks: 3, 3, 3, 1
    auto t = torch::randn({10, 3});
    torch::manual_seed(5);
    auto expected_loss = reference_step(seq, x, t, 4, ascending);
    auto expected = grads_of(*seq);
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, b, sw::PipeOptions().chunks(4).checkpoint(mode));
    torch::manual_seed(5);
    torch::Tensor loss = pipe->train_step(x, t, mse, s);
    CHECK(loss.item<float>() == expected_loss.item<float>());
    auto got = grads_of(*seq);
    REQUIRE(got.size() == expected.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      REQUIRE(got[k].defined());
      CHECK(got[k].equal(expected[k]));
    }
  }
}

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
        "micro-batch is)"));
  }
}
