#include "stagewise/pipe.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "tests/support/autocast.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sw = stagewise;
using stagewise::testing::set_cpu_autocast;

namespace {

// CPU autocast (bf16, the default CPU dtype) for its lifetime; like leaving an autocast region,
// clears this thread's cast cache at the end.
struct CpuAutocast {
  CpuAutocast() { set_cpu_autocast(true); }
  ~CpuAutocast() {
    set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
};

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out.to(torch::kFloat), target);
}

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

void check_same(torch::nn::Module& a, torch::nn::Module& b, const std::string& what) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t k = 0; k < pa.size(); ++k) {
    INFO(what << ", parameter " << k);
    REQUIRE(pa[k].grad().defined());
    CHECK(pa[k].grad().dtype() == pb[k].grad().dtype());
    CHECK(pa[k].grad().equal(pb[k].grad()));
    CHECK(pa[k].equal(pb[k]));
  }
}

}  // namespace

TEST_SUITE("autocast") {
  TEST_CASE(
      "checkpoint never under CPU bf16 autocast: every step equals the unpipelined model, "
      "across optimizer steps") {
    torch::manual_seed(0);
    auto seq = mlp();
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    auto pipe = sw::Pipe(seq, sw::balance{2, 3}, sw::PipeOptions().chunks(2).checkpoint("never"));
    torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
    const auto x = torch::randn({4, 6});
    const auto t = torch::randn({4, 3});
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      {
        CpuAutocast autocast;
        pipe->train_step(x, t, mse);
      }
      {
        CpuAutocast autocast;
        sw::testing::reference_step(*ref, x, t, 2, /*ascending=*/false, mse);
      }
      check_same(*pipe, *ref, "train_step " + std::to_string(step));
      opt.step();
      ref_opt.step();
    }
  }

  TEST_CASE(
      "checkpoint never under CPU bf16 autocast: forward() after an optimizer step equals "
      "the unpipelined model") {
    torch::manual_seed(1);
    auto seq = mlp();
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    auto pipe = sw::Pipe(seq, sw::balance{2, 3}, sw::PipeOptions().chunks(2).checkpoint("never"));
    torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
    const auto x = torch::randn({4, 6});
    const auto t = torch::randn({4, 3});
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      torch::Tensor out;
      torch::Tensor ref_out;
      {
        CpuAutocast autocast;
        out = pipe->forward(x);
        ref_out = torch::cat({ref->forward(x.chunk(2)[0]), ref->forward(x.chunk(2)[1])});
      }
      CHECK(out.dtype() == ref_out.dtype());
      CHECK(out.equal(ref_out));
      mse(out, t).backward();
      mse(ref_out, t).backward();
      check_same(*pipe, *ref, "forward " + std::to_string(step));
      opt.step();
      ref_opt.step();
    }
  }

  TEST_CASE(
      "checkpointed forward() under CPU bf16 autocast equals the unpipelined model back-propagated "
      "micro-batch by micro-batch, with backward inside or outside the autocast region") {
    for (auto mode : {sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      for (bool backward_inside : {true, false}) {
        const std::string mode_name = sw::to_string(mode);
        CAPTURE(mode_name);
        CAPTURE(backward_inside);
        torch::manual_seed(4);
        auto seq = mlp();
        auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
        auto pipe = sw::Pipe(seq, sw::balance{2, 3}, sw::PipeOptions().chunks(3).checkpoint(mode));
        torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.5));
        torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
        const auto x = torch::randn({6, 6});
        const auto t = torch::randn({6, 3});
        for (int step = 0; step < 3; ++step) {
          CAPTURE(step);
          opt.zero_grad();
          ref_opt.zero_grad();
          // The pipe's checkpointed micro-batches back-propagate one by one (each recompute's
          // own backward), so the reference does too: the gradient of the whole-batch loss at
          // each micro-batch's output, then one backward per micro-batch, M-1 .. 0.
          torch::Tensor out;
          std::vector<torch::Tensor> ref_outs;
          {
            CpuAutocast autocast;
            out = pipe->forward(x);
            for (const auto& xi : x.chunk(3)) ref_outs.push_back(ref->forward(xi));
            if (backward_inside) mse(out, t).backward();
          }
          if (!backward_inside) mse(out, t).backward();
          std::vector<torch::Tensor> cut;
          for (const auto& y : ref_outs) cut.push_back(y.detach().requires_grad_());
          mse(torch::cat(cut), t).backward();
          for (int i = 2; i >= 0; --i) ref_outs[i].backward(cut[i].grad());
          CHECK(out.dtype() == torch::kBFloat16);
          CHECK(out.equal(torch::cat(ref_outs)));
          check_same(*pipe, *ref, "forward " + std::to_string(step));
          opt.step();
          ref_opt.step();
        }
      }
    }
  }
}
