#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <vector>

namespace sw = stagewise;

namespace {

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); }

// A stage whose middle is two experts run by ParallelBranches, summed.
struct MoeStageImpl : torch::nn::Module {
  MoeStageImpl() {
    in = register_module("in", torch::nn::Linear(6, 8));
    experts = register_module("experts", sw::ParallelBranches(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(in->forward(x));
    auto outs = experts->forward(h);
    return outs[0] + outs[1];
  }
  torch::nn::Linear in{nullptr};
  sw::ParallelBranches experts{nullptr};
};
TORCH_MODULE(MoeStage);

std::vector<torch::Tensor> grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST_SUITE("parallel branches in the pipeline") {
  TEST_CASE("inside a pipeline stage, every checkpoint mode: gradients equal the unpipelined model") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      torch::manual_seed(8);
      MoeStage moe;
      torch::nn::Linear head(8, 3);
      auto x = torch::randn({6, 6});
      auto t = torch::randn({6, 3});
      // Unpipelined on the same micro-batches, backward in reverse order as each stage runs it.
      std::vector<torch::Tensor> losses;
      for (std::size_t i = 0; i < 3; ++i) {
        losses.push_back(mse(head->forward(moe->forward(x.chunk(3)[i])), t.chunk(3)[i]) * (2.0 / 6.0));
      }
      for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();
      auto expected = grads(*moe);
      moe->zero_grad();
      head->zero_grad();
      auto pipe = sw::Pipe(sw::stages(moe, head), sw::PipeOptions().chunks(3).checkpoint(mode));
      pipe->train_step(x, t, mse);
      auto got = grads(*moe);
      REQUIRE(got.size() == expected.size());
      for (std::size_t k = 0; k < got.size(); ++k) CHECK(torch::allclose(got[k], expected[k], 1e-6, 1e-7));
    }
  }

  TEST_CASE("under stagewise::checkpoint: outputs and gradients equal the plain run") {
    torch::manual_seed(9);
    MoeStage moe;
    auto x = torch::randn({4, 6}, torch::requires_grad());
    moe->forward(x).pow(2).sum().backward();
    auto gx = x.grad().clone();
    auto gw = grads(*moe);
    x.mutable_grad().reset();
    moe->zero_grad();
    auto y = sw::checkpoint([&](const torch::Tensor& in) { return moe->forward(in); }, x);
    y.pow(2).sum().backward();
    CHECK(torch::allclose(x.grad(), gx, 1e-6, 1e-7));
    auto got = grads(*moe);
    for (std::size_t k = 0; k < got.size(); ++k) CHECK(torch::allclose(got[k], gw[k], 1e-6, 1e-7));
  }
}
