#include "tests/optim/test_models.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <limits>
#include <stdexcept>
#include <vector>

namespace sw = stagewise;
namespace optim = torch::optim;
using test::Net;
using test::NetConfig;

namespace {

// The data of step `s`, drawn before the forward, outside any closure.
std::pair<torch::Tensor, torch::Tensor> batch(int s) {
  torch::manual_seed(1000 + s);
  return {torch::randn({8, 6}), torch::randn({8, 3})};
}

// Loss of one step over `m` micro-batches, with a backward per micro-batch when `backward`
// (then the loss returned is detached).
torch::Tensor step_loss(Net& net, const torch::Tensor& x, const torch::Tensor& y, int m,
                        bool backward) {
  if (m == 1 && !backward) return torch::mse_loss(net->forward(x), y);
  auto xs = x.chunk(m);
  auto ys = y.chunk(m);
  torch::Tensor total = torch::zeros({});
  for (int i = 0; i < m; ++i) {
    auto loss = torch::mse_loss(net->forward(xs[i]), ys[i]) / m;
    if (backward) loss.backward();
    total = total + loss.detach();
  }
  return total;
}

struct Trained {
  Net net;
  std::vector<double> norms{};     // total norm of each step
  std::vector<float> after_rng{};  // a random draw after each step: where the generator stands
  bool grads_empty = true;
};

// The reference: forward and backward once, clip_grad_norm_, the unfused step, zero_grad.
template <class Options>
Trained unfused(Options options, NetConfig cfg, double max_norm, double norm_type) {
  Trained t{test::make_net(cfg)};
  typename sw::optim::optimizer_for<Options>::type opt(t.net->parameters(), options);
  for (int s = 0; s < 10; ++s) {
    auto [x, y] = batch(s);
    step_loss(t.net, x, y, cfg.micro_batches, /*backward=*/true);
    t.norms.push_back(torch::nn::utils::clip_grad_norm_(t.net->parameters(), max_norm, norm_type));
    opt.step();
    opt.zero_grad();
    t.after_rng.push_back(torch::rand({}).item<float>());
  }
  return t;
}

template <class Options>
Trained fused(Options options, NetConfig cfg, double max_norm, double norm_type) {
  Trained t{test::make_net(cfg)};
  sw::optim::FusedStep step(t.net->parameters(), options);
  const int m = cfg.micro_batches;
  step.set_accumulation_steps(m);
  for (int s = 0; s < 10; ++s) {
    auto [x, y] = batch(s);
    sw::optim::ClipStepResult r;
    if (m == 1) {
      r = sw::optim::clip_grad_norm_step(
          step, [&] { return step_loss(t.net, x, y, 1, false); }, max_norm, norm_type);
      CHECK(r.loss.defined());
    } else {
      // Micro-batches: the closure runs its own backward passes and returns nothing.
      r = sw::optim::clip_grad_norm_step(
          step, [&] { step_loss(t.net, x, y, m, true); }, max_norm, norm_type);
      CHECK_FALSE(r.loss.defined());
    }
    t.norms.push_back(r.total_norm);
    t.grads_empty = t.grads_empty && test::all_grads_empty(t.net->parameters());
    step.finish_step();
    t.after_rng.push_back(torch::rand({}).item<float>());
  }
  return t;
}

template <class Options>
void check_clipped(Options options, NetConfig cfg, double max_norm, double norm_type = 2.0) {
  auto reference = unfused(options, cfg, max_norm, norm_type);
  auto result = fused(options, cfg, max_norm, norm_type);
  CHECK(test::max_abs_diff(reference.net->parameters(), result.net->parameters()) == 0.0);
  CHECK(result.norms == reference.norms);
  CHECK(result.after_rng == reference.after_rng);
  CHECK(result.grads_empty);
}

const auto adam = optim::AdamOptions(1e-2).weight_decay(1e-3);
const auto sgd = optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);

}  // namespace

TEST_SUITE("clip_grad_norm_step equals clip_grad_norm_ then the unfused step") {
  TEST_CASE("Adam, 2-norm, clipping every step, dropout masks replayed: bit-identical") {
    auto reference = unfused(adam, {}, 0.05, 2.0);
    for (double norm : reference.norms) CHECK(norm > 0.05);  // the clip really acts
    check_clipped(adam, {}, 0.05);
  }
  TEST_CASE("SGD with momentum and a max_norm that never clips: still bit-identical") {
    auto reference = unfused(sgd, {}, 1e6, 2.0);
    for (double norm : reference.norms) CHECK(norm < 1e6);
    check_clipped(sgd, {}, 1e6);
  }
  TEST_CASE("AdamW with the infinity norm and with the 1-norm") {
    check_clipped(optim::AdamWOptions(1e-2), {}, 0.01, std::numeric_limits<double>::infinity());
    check_clipped(optim::AdamWOptions(1e-2), {}, 0.1, 1.0);
  }
  TEST_CASE("with micro-batches, the closure running its own backward passes (k = M)") {
    check_clipped(adam, NetConfig{.micro_batches = 4}, 0.05);
  }
  TEST_CASE("under the checkpoint stand-in the recompute happens in both passes, still exact") {
    check_clipped(adam, NetConfig{.checkpoint = true}, 0.05);
  }
}

TEST_SUITE("clip_grad_norm_step passes") {
  TEST_CASE("the norm pass steps nothing: after one clipped step Adam has taken exactly one step") {
    auto net = test::make_net({});
    sw::optim::FusedStep step(net->parameters(), adam);
    auto [x, y] = batch(0);
    sw::optim::clip_grad_norm_step(
        step, [&] { return step_loss(net, x, y, 1, false); }, 0.1);
    CHECK(step.stepped_this_step() == 6);
    for (std::size_t i = 0; i < step.size(); ++i) {
      const auto& state = step.optimizer(i).state();
      REQUIRE(state.size() == 1);
      CHECK(static_cast<const optim::AdamParamState&>(*state.begin()->second).step() == 1);
    }
    step.finish_step();
  }
  TEST_CASE("an exception in the closure leaves nothing half done") {
    auto net = test::make_net({});
    sw::optim::FusedStep step(net->parameters(), adam);
    const auto before = net->a->weight.detach().clone();
    auto [x, y] = batch(0);
    int calls = 0;
    auto failing = [&] {
      auto loss = step_loss(net, x, y, 1, false);
      if (++calls == 2) throw std::runtime_error("data went away");
      return loss;
    };
    CHECK_THROWS_WITH(sw::optim::clip_grad_norm_step(step, failing, 0.1), "data went away");
    CHECK(torch::equal(net->a->weight, before));
    CHECK(test::all_grads_empty(net->parameters()));
    step_loss(net, x, y, 1, true);  // an ordinary fused step still works
    CHECK_FALSE(torch::equal(net->a->weight, before));
    step.finish_step();
  }
  TEST_CASE("a detached fused step is refused with the fix in the message") {
    auto net = test::make_net({});
    sw::optim::FusedStep step(net->parameters(), adam);
    step.detach();
    auto [x, y] = batch(0);
    CHECK_THROWS_WITH(sw::optim::clip_grad_norm_step(
                          step, [&] { return step_loss(net, x, y, 1, false); }, 1.0),
                      doctest::Contains("the fused step is detached. Call attach() first"));
  }
}
