#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); }

torch::nn::Sequential make_model() {
  torch::manual_seed(21);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::ReLU(), torch::nn::Linear(8, 3));
}

double max_abs_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters();
  auto pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return worst;
}

// 10 steps inside a pipeline: fused into backward vs train_step + the unfused optimizer.
template <class Options, class Optimizer>
void check_pipeline(Options options, sw::Checkpoint mode) {
  auto fused_model = make_model();
  auto plain_model = make_model();
  auto fused_pipe = sw::Pipe(fused_model, sw::balance{2, 3}, sw::PipeOptions().chunks(3).checkpoint(mode));
  auto plain_pipe = sw::Pipe(plain_model, sw::balance{2, 3}, sw::PipeOptions().chunks(3).checkpoint(mode));
  sw::optim::FusedStep fused(fused_pipe->parameters(), options);
  Optimizer plain(plain_pipe->parameters(), options);
  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({7, 6});
    auto t = torch::randn({7, 3});
    torch::Tensor a = fused_pipe->train_step(x, t, mse, fused);
    plain.zero_grad();
    torch::Tensor b = plain_pipe->train_step(x, t, mse);
    plain.step();
    CHECK(a.item<float>() == b.item<float>());
    for (auto& p : fused_pipe->parameters()) CHECK_FALSE(p.grad().defined());
  }
  CHECK(max_abs_diff(*fused_model, *plain_model) == 0.0);
}

}  // namespace

TEST_SUITE("fused step in a pipeline") {
  TEST_CASE("SGD with momentum and weight decay is bit-identical to the unfused pipeline, every mode") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      check_pipeline<torch::optim::SGDOptions, torch::optim::SGD>(
          torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3), mode);
    }
  }

  TEST_CASE("Adam is bit-identical to the unfused pipeline, every mode") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      check_pipeline<torch::optim::AdamOptions, torch::optim::Adam>(torch::optim::AdamOptions(1e-2), mode);
    }
  }

  TEST_CASE("AdamW is bit-identical to the unfused pipeline, every mode") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      check_pipeline<torch::optim::AdamWOptions, torch::optim::AdamW>(
          torch::optim::AdamWOptions(1e-2).weight_decay(0.1), mode);
    }
  }

  TEST_CASE("clip_grad_norm_step around the fused train_step equals clip_grad_norm_ + AdamW") {
    // The norm pass runs a whole fused train_step, whose finish_step must keep the norms it
    // measured for the clip (it used to drop them: clip_grad_norm_step then stacked empty norms).
    auto fused_model = make_model();
    auto plain_model = make_model();
    auto options = sw::PipeOptions().chunks(3);
    auto fused_pipe = sw::Pipe(fused_model, sw::balance{2, 3}, options);
    auto plain_pipe = sw::Pipe(plain_model, sw::balance{2, 3}, options);
    const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    sw::optim::FusedStep fused(fused_pipe->parameters(), adamw);
    torch::optim::AdamW plain(plain_pipe->parameters(), adamw);
    for (int step = 0; step < 5; ++step) {
      auto x = torch::randn({7, 6}) * 10;
      auto t = torch::randn({7, 3});
      torch::Tensor a;
      const auto r = sw::optim::clip_grad_norm_step(
          fused, [&] { a = fused_pipe->train_step(x, t, mse, fused, sw::schedule::one_f_one_b{}); },
          0.5);
      for (auto& p : plain_pipe->parameters()) p.mutable_grad().reset();
      torch::Tensor b = plain_pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
      const double norm = torch::nn::utils::clip_grad_norm_(plain_pipe->parameters(), 0.5);
      plain.step();
      CHECK(a.item<float>() == b.item<float>());
      CHECK(r.total_norm == norm);
      CHECK(r.total_norm > 0.5);  // it clipped
    }
    CHECK(max_abs_diff(*fused_model, *plain_model) == 0.0);
  }

  TEST_CASE("a failing step resets the fused step, which then works again") {
    auto model = make_model();
    bool fail = true;
    auto pipe = sw::Pipe(sw::stages(model, [&](const torch::Tensor& x) -> torch::Tensor {
                           if (fail) throw std::runtime_error("stage failed");
                           return x;
                         }),
                         sw::PipeOptions().chunks(2));
    sw::optim::FusedStep fused(pipe->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_AS(pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, fused),
                    std::runtime_error);
    fail = false;
    auto before = model->parameters()[0].detach().clone();
    pipe->train_step(torch::randn({4, 6}), torch::randn({4, 3}), mse, fused);
    CHECK_FALSE(model->parameters()[0].equal(before));
    CHECK(fused.stepped_this_step() == 0);  // finish_step ran
  }
}

TEST_SUITE("fused step with stagewise::checkpoint") {
  // One layer used in two checkpointed regions: it receives two gradients per backward, and each
  // recompute must still see the weights of this step, not updated ones.
  struct Twice {
    torch::nn::Linear shared{4, 4};
    torch::nn::Linear head{4, 1};
    torch::Tensor operator()(const torch::Tensor& x) {
      auto f = [&](const torch::Tensor& h) { return torch::tanh(shared->forward(h)); };
      return head->forward(sw::checkpoint(f, sw::checkpoint(f, x)));
    }
  };

  TEST_CASE("with k = 2 for the shared layer, 10 steps equal the unfused Adam exactly") {
    torch::manual_seed(5);
    Twice a;
    Twice b;
    {
      torch::NoGradGuard no_grad;
      b.shared->weight.copy_(a.shared->weight);
      b.shared->bias.copy_(a.shared->bias);
      b.head->weight.copy_(a.head->weight);
      b.head->bias.copy_(a.head->bias);
    }
    std::vector<torch::Tensor> params_a = a.shared->parameters();
    for (auto& p : a.head->parameters()) params_a.push_back(p);
    std::vector<torch::Tensor> params_b = b.shared->parameters();
    for (auto& p : b.head->parameters()) params_b.push_back(p);
    sw::optim::FusedStep fused(params_a, torch::optim::AdamOptions(1e-2));
    fused.set_accumulation_steps(2, a.shared->parameters());
    torch::optim::Adam plain(params_b, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 10; ++step) {
      auto x = torch::randn({5, 4});
      a(x).pow(2).mean().backward();
      fused.finish_step();
      plain.zero_grad();
      b(x).pow(2).mean().backward();
      plain.step();
    }
    for (std::size_t i = 0; i < params_a.size(); ++i) CHECK(params_a[i].equal(params_b[i]));
  }

  TEST_CASE("without k = 2 the second recompute would see updated weights: finish_step says so") {
    Twice a;
    std::vector<torch::Tensor> params = a.shared->parameters();
    for (auto& p : a.head->parameters()) params.push_back(p);
    sw::optim::FusedStep fused(params, torch::optim::SGDOptions(0.1));
    a(torch::randn({3, 4})).sum().backward();
    CHECK(contains(error_of([&] { fused.finish_step(); }), "stepped 2 times"));
  }
}
