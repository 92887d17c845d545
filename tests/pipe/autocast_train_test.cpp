// train_step under CPU bf16 autocast: in every checkpoint mode and with every schedule, each
// parameter's gradient (biases included) has the dtype and the value of unpipelined training on
// the same micro-batches under the same autocast, step after optimizer step.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/looped_bfs.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/v_half.hpp"
#include "stagewise/schedule/v_min.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include <torch/torch.h>

#include "tests/support/autocast.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::CpuAutocastRegion;

namespace {

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out.to(torch::kFloat), target);
}

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3), torch::nn::Tanh());
}

// Three SGD steps of the pipe and of the reference, each under CPU autocast, in every mode.
template <class Schedule>
void check_steps(const Schedule& s, const sw::balance& b, bool ascending) {
  for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
    const std::string mode_name = sw::to_string(mode);
    CAPTURE(mode_name);
    torch::manual_seed(7);
    auto seq = mlp();
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    auto pipe = sw::Pipe(seq, b, sw::PipeOptions().chunks(4).checkpoint(mode));
    torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
    const auto x = torch::randn({10, 6});  // 4 chunks: 3, 3, 3, 1 rows
    const auto t = torch::randn({10, 3});
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      opt.zero_grad();
      ref_opt.zero_grad();
      torch::Tensor loss;
      torch::Tensor expected_loss;
      {
        CpuAutocastRegion region;
        loss = pipe->train_step(x, t, mse, s);
      }
      {
        CpuAutocastRegion region;
        // The reference runs under the caller's autocast, with this file's mse.
        expected_loss = sw::testing::reference_step(*ref, x, t, 4, ascending, mse);
      }
      CHECK(loss.item<float>() == expected_loss.item<float>());
      auto got = pipe->parameters();
      auto expected = ref->parameters();
      REQUIRE(got.size() == expected.size());
      for (std::size_t k = 0; k < got.size(); ++k) {
        CAPTURE(k);
        REQUIRE(got[k].grad().defined());
        CHECK(got[k].grad().dtype() == expected[k].grad().dtype());
        CHECK(got[k].grad().equal(expected[k].grad()));
        CHECK(got[k].equal(expected[k]));
      }
      opt.step();
      ref_opt.step();
    }
  }
}

}  // namespace

TEST_SUITE("autocast: train_step") {
  TEST_CASE("GPipe under bf16 autocast equals the unpipelined model in every checkpoint mode") {
    check_steps(sched::gpipe{}, sw::balance{3, 5}, false);
  }

  TEST_CASE("1F1B under bf16 autocast equals the unpipelined model in every checkpoint mode") {
    check_steps(sched::one_f_one_b{}, sw::balance{3, 5}, true);
  }

  TEST_CASE("interleaved 1F1B under bf16 autocast equals the unpipelined model in every mode") {
    check_steps(sched::interleaved_one_f_one_b{2}, sw::balance{2, 2, 2, 2}, true);
  }

  TEST_CASE("ZB-H1 under bf16 autocast equals the unpipelined model in every checkpoint mode") {
    check_steps(sched::zero_bubble_h1{}, sw::balance{3, 5}, true);
  }

  TEST_CASE("looped BFS under bf16 autocast equals the unpipelined model in every mode") {
    check_steps(sched::looped_bfs{2}, sw::balance{2, 2, 2, 2}, false);
  }

  TEST_CASE("ZB-V under bf16 autocast equals the unpipelined model in every checkpoint mode") {
    check_steps(sched::zero_bubble_v{}, sw::balance{2, 2, 2, 2}, true);
  }

  TEST_CASE("V-Half and V-Min under bf16 autocast equal the unpipelined model in every mode") {
    check_steps(sched::v_half{}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
    check_steps(sched::v_min{}, sw::balance{1, 1, 1, 1, 1, 1, 1, 1}, true);
  }

  TEST_CASE("DualPipeV under bf16 autocast equals the unpipelined model in every mode") {
    check_steps(sched::dualpipe_v{}, sw::balance{2, 2, 2, 2}, true);
  }

  TEST_CASE("a one-Linear pipe checkpointed always gives its bias a gradient under autocast") {
    torch::manual_seed(2);
    torch::nn::Linear lin(8, 4);
    auto ref = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lin->clone());
    auto pipe = sw::Pipe(sw::stages(lin), sw::PipeOptions().chunks(2).checkpoint("always"));
    const auto x = torch::randn({4, 8});
    const auto t = torch::randn({4, 4});
    {
      CpuAutocastRegion region;
      pipe->train_step(x, t, mse);
    }
    {
      CpuAutocastRegion region;
      auto xs = x.chunk(2);
      auto ts = t.chunk(2);
      auto l0 = mse(ref->forward(xs[0]), ts[0]) * 0.5;
      auto l1 = mse(ref->forward(xs[1]), ts[1]) * 0.5;
      l1.backward();
      l0.backward();
    }
    REQUIRE(lin->bias.grad().defined());
    CHECK(lin->bias.grad().dtype() == torch::kFloat);
    CHECK(lin->bias.grad().equal(ref->bias.grad()));
    CHECK(lin->weight.grad().equal(ref->weight.grad()));
  }
}
