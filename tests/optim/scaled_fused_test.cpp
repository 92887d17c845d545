// The fused step under amp::GradScaler: scaler.step(fused, closure) and clip_grad_norm_step with a
// scaler equal GradScaler + (clip_grad_norm_ +) the unfused optimizer bit for bit over many steps
// with overflows injected (same parameters, scales, skips, norms and random generators); a skipped
// step changes no parameter and no optimizer state; a closure that scales nothing is refused.
#include "tests/optim/test_models.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <vector>

namespace sw = stagewise;
using test::Net;
using test::NetConfig;

namespace {

constexpr int kSteps = 10;
const std::set<int> kBad = {2, 3, 7};  // an inf (even) or a NaN (odd) in one gradient

std::pair<torch::Tensor, torch::Tensor> batch(int s) {
  torch::manual_seed(500 + s);
  return {torch::randn({8, 6}), torch::randn({8, 3})};
}

// The loss of micro-batch i of m of step s: at a bad step the last layer's bias gets an inf or a
// NaN gradient (the other gradients stay finite).
torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y, int s) {
  auto loss = torch::mse_loss(net->forward(x), y);
  if (kBad.count(s)) {
    const float bad = s % 2 == 0 ? std::numeric_limits<float>::infinity()
                                 : std::numeric_limits<float>::quiet_NaN();
    loss = loss + net->c_->bias.sum() * bad;
  }
  return loss;
}

struct Run {
  Net net;
  std::vector<double> scales{}, norms{};
  std::vector<bool> stepped{};
  std::vector<float> after_rng{};
};

sw::amp::GradScaler make_scaler() {
  return sw::amp::GradScaler(sw::amp::GradScalerOptions().init_scale(1024).growth_interval(3));
}

// GradScaler with the unfused Adam: scale(loss).backward() per micro-batch, unscale_ and
// clip_grad_norm_ when clipping, step, update.
Run unfused(NetConfig cfg, std::optional<double> max_norm) {
  Run r{test::make_net(cfg)};
  torch::optim::Adam opt(r.net->parameters(), torch::optim::AdamOptions(1e-2));
  auto scaler = make_scaler();
  const int m = cfg.micro_batches;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    auto xs = x.chunk(m), ys = y.chunk(m);
    for (int i = 0; i < m; ++i) scaler.scale(loss_of(r.net, xs[i], ys[i], s) / m).backward();
    if (max_norm) {
      scaler.unscale_(opt);
      r.norms.push_back(torch::nn::utils::clip_grad_norm_(r.net->parameters(), *max_norm));
    }
    r.stepped.push_back(scaler.step(opt));
    scaler.update();
    r.scales.push_back(scaler.get_scale());
    for (auto& p : r.net->parameters()) p.mutable_grad().reset();
    r.after_rng.push_back(torch::rand({}).item<float>());
  }
  return r;
}

// The same with the fused Adam: scaler.step(fused, closure), or clip_grad_norm_step with the
// scaler. With one micro-batch the closure returns its loss (the step scales it); with several it
// runs its own scaled backward passes.
Run fused(NetConfig cfg, std::optional<double> max_norm) {
  Run r{test::make_net(cfg)};
  sw::optim::FusedStep fused(r.net->parameters(), torch::optim::AdamOptions(1e-2));
  auto scaler = make_scaler();
  const int m = cfg.micro_batches;
  fused.set_accumulation_steps(m);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    auto returning = [&] { return loss_of(r.net, x, y, s); };
    auto own = [&] {
      auto xs = x.chunk(m), ys = y.chunk(m);
      for (int i = 0; i < m; ++i) scaler.scale(loss_of(r.net, xs[i], ys[i], s) / m).backward();
    };
    if (max_norm) {
      auto c = m == 1 ? sw::optim::clip_grad_norm_step(fused, returning, *max_norm, scaler)
                      : sw::optim::clip_grad_norm_step(fused, own, *max_norm, scaler);
      r.norms.push_back(c.total_norm);
      r.stepped.push_back(c.stepped);
    } else {
      r.stepped.push_back(m == 1 ? scaler.step(fused, returning) : scaler.step(fused, own));
    }
    fused.finish_step();
    scaler.update();
    r.scales.push_back(scaler.get_scale());
    CHECK(test::all_grads_empty(r.net->parameters()));
    r.after_rng.push_back(torch::rand({}).item<float>());
  }
  return r;
}

bool same(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  }
  return true;
}

void check_equal(NetConfig cfg, std::optional<double> max_norm) {
  const auto a = unfused(cfg, max_norm);
  const auto b = fused(cfg, max_norm);
  CHECK(test::max_abs_diff(a.net->parameters(), b.net->parameters()) == 0.0);
  CHECK(a.scales == b.scales);
  CHECK(a.stepped == b.stepped);
  CHECK(same(a.norms, b.norms));
  CHECK(a.after_rng == b.after_rng);
  for (int s = 0; s < kSteps; ++s) CHECK(a.stepped[s] == (kBad.count(s) == 0));
  if (max_norm) {
    int clipped = 0;
    for (int s = 0; s < kSteps; ++s) clipped += !kBad.count(s) && a.norms[s] > *max_norm;
    CHECK(clipped > 0);
  }
}

// Adam's state of every parameter: step count and both moments.
std::vector<torch::Tensor> adam_state(sw::optim::FusedStep& fused) {
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < fused.size(); ++i) {
    for (const auto& [key, state] : fused.optimizer(i).state()) {
      auto& adam = static_cast<torch::optim::AdamParamState&>(*state);
      out.push_back(torch::tensor(adam.step()));
      out.push_back(adam.exp_avg().clone());
      out.push_back(adam.exp_avg_sq().clone());
    }
  }
  return out;
}

}  // namespace

TEST_SUITE("the fused step under a GradScaler equals GradScaler + the unfused optimizer") {
  TEST_CASE("scaler.step(fused, closure), overflows injected, dropout replayed: bit for bit") {
    check_equal({}, std::nullopt);
  }
  TEST_CASE("clip_grad_norm_step with the scaler: unscale_, clip_grad_norm_, step, bit for bit") {
    check_equal({}, 0.05);
  }
  TEST_CASE("micro-batches scaled by the closure, checkpointed block: with and without clip") {
    check_equal({.checkpoint = true, .micro_batches = 2}, std::nullopt);
    check_equal({.checkpoint = true, .micro_batches = 2}, 0.05);
  }

  TEST_CASE("a skipped step changes no parameter and no optimizer state") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), torch::optim::AdamOptions(1e-2));
    auto scaler = make_scaler();
    auto [x, y] = batch(0);
    CHECK(scaler.step(fused, [&] { return loss_of(net, x, y, 0); }));
    scaler.update();
    std::vector<torch::Tensor> before;
    for (auto& p : net->parameters()) before.push_back(p.detach().clone());
    const auto state = adam_state(fused);
    CHECK_FALSE(scaler.step(fused, [&] { return loss_of(net, x, y, 2); }));  // inf: skipped
    for (std::size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(before[i], net->parameters()[i]));
    const auto after = adam_state(fused);
    REQUIRE(after.size() == state.size());
    for (std::size_t i = 0; i < state.size(); ++i) CHECK(torch::equal(state[i], after[i]));
    CHECK(test::all_grads_empty(net->parameters()));
    CHECK(scaler.get_scale() == 1024.0);
    scaler.update();
    CHECK(scaler.get_scale() == 512.0);
  }

  TEST_CASE("a closure that scales no loss is refused, and nothing steps") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), torch::optim::SGDOptions(0.1));
    auto scaler = make_scaler();
    auto [x, y] = batch(0);
    const auto before = net->parameters()[0].detach().clone();
    // A scaler that never scaled has no scale to unscale by.
    CHECK(sw::testing::error_of([&] {
            scaler.step(fused, [&] { loss_of(net, x, y, 0).backward(); });
          }) ==
          "stagewise::amp::GradScaler: a gradient arrived before any loss was scaled. Scale the "
          "loss the closure back-propagates (scaler.scale(loss).backward(), or return the loss "
          "and let the step scale it)");
    scaler.scale(torch::ones({}));  // one that has a scale, as after earlier steps
    CHECK(sw::testing::error_of([&] {
            scaler.step(fused, [&] { loss_of(net, x, y, 0).backward(); });
          }) ==
          "stagewise::amp::GradScaler::step: the closure back-propagated a loss the GradScaler "
          "did not scale, so its gradients are not scaled. Return the loss from the closure (the "
          "step scales it), call scaler.scale(loss).backward() in it, or pass the scaler to the "
          "pipe's train_step (pipe->train_step(x, y, loss_fn, fused, scaler))");
    CHECK(torch::equal(before, net->parameters()[0]));
    CHECK(test::all_grads_empty(net->parameters()));
    // The fused step and the scaler still work.
    CHECK(scaler.step(fused, [&] { return loss_of(net, x, y, 0); }));
    CHECK_FALSE(torch::equal(before, net->parameters()[0]));
  }

  TEST_CASE("a disabled scaler runs the closure once, as the plain fused step") {
    auto a = test::make_net({}), b = test::make_net({});
    sw::optim::FusedStep fa(a->parameters(), torch::optim::SGDOptions(0.1));
    sw::optim::FusedStep fb(b->parameters(), torch::optim::SGDOptions(0.1));
    sw::amp::GradScaler off(sw::amp::GradScalerOptions().enabled(false));
    auto [x, y] = batch(1);
    int calls = 0;
    torch::manual_seed(3);
    CHECK(off.step(fa, [&] { ++calls; return loss_of(a, x, y, 1); }));
    fa.finish_step();
    torch::manual_seed(3);
    loss_of(b, x, y, 1).backward();
    fb.finish_step();
    CHECK(calls == 1);
    CHECK(test::max_abs_diff(a->parameters(), b->parameters()) == 0.0);
  }
}
