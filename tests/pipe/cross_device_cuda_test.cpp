#include "stagewise/pipe.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sw = stagewise;

namespace {

const bool fewer_than_two = torch::cuda::device_count() < 2;

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Trains a two-stage pipe with stage 0 on cuda:0 and stage 1 on cuda:1 for one step of `sched`,
// and the same model on cuda:0 alone on the same micro-batches; every gradient must be on its
// parameter's device and equal the single-device one.
template <class Schedule>
void check_two_devices(const Schedule& sched, const std::string& checkpoint) {
  const torch::Device gpu0(torch::kCUDA, 0);
  const torch::Device gpu1(torch::kCUDA, 1);
  torch::manual_seed(0);
  auto seq =
      torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                            torch::nn::Tanh(), torch::nn::Linear(8, 3));
  auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
  ref->to(gpu0);
  auto pipe = sw::Pipe(seq, sw::balance{2, 3},
                       sw::PipeOptions().chunks(4).checkpoint(checkpoint).devices({gpu0, gpu1}));
  const auto x = torch::randn({8, 6}, gpu0);
  const auto t = torch::randn({8, 3}, gpu0);
  pipe->train_step(x, t.to(gpu1), mse, sched);

  auto xs = x.chunk(4);
  auto ts = t.chunk(4);
  std::vector<torch::Tensor> losses;
  for (std::size_t i = 0; i < xs.size(); ++i) losses.push_back(mse(ref->forward(xs[i]), ts[i]) / 4);
  for (auto it = losses.rbegin(); it != losses.rend(); ++it) it->backward();

  auto got = pipe->parameters();
  auto want = ref->parameters();
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("parameter " << k << ", checkpoint " << checkpoint);
    REQUIRE(got[k].grad().defined());
    CHECK(got[k].grad().device() == got[k].device());
    CHECK(got[k].grad().to(gpu0).allclose(want[k].grad(), 1e-5, 1e-6));
  }
}

}  // namespace

TEST_SUITE("gradients across devices") {
  TEST_CASE("two_cuda: train_step moves each input gradient to the previous stage's device" *
            doctest::skip(fewer_than_two)) {
    for (const std::string mode : {"never", "except_last", "always"}) {
      check_two_devices(sw::schedule::gpipe{}, mode);
      check_two_devices(sw::schedule::one_f_one_b{}, mode);
    }
    check_two_devices(sw::schedule::zero_bubble_h1{}, "never");
  }
}
