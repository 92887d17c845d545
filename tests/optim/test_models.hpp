#pragma once

// Shared by the optim tests: a small net, a stand-in for checkpointing, and training helpers that
// run the same data (seeded per step) through the unfused and the fused optimizer.

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace test {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using LayerFn = std::function<torch::Tensor(const torch::Tensor&)>;

// Called at the start of every recompute; tests use it to look at the weights then.
inline std::function<void()>& on_recompute() {
  static std::function<void()> probe;
  return probe;
}

// A minimal stand-in for reentrant checkpointing (what stagewise::checkpoint will do): forward
// runs `fn` under no-grad and keeps only its input; backward re-runs `fn` with grad enabled and
// back-propagates through the recomputed graph with torch::autograd::backward, so the
// parameters inside get their gradients in that inner backward pass.
struct CheckpointStandIn : torch::autograd::Function<CheckpointStandIn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, const LayerFn* fn) {
    ctx->saved_data["fn"] = reinterpret_cast<std::int64_t>(fn);
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;
    return (*fn)(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* fn = reinterpret_cast<const LayerFn*>(ctx->saved_data["fn"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    if (on_recompute()) on_recompute()();
    torch::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      y = (*fn)(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

struct NetConfig {
  bool checkpoint = false;  // run the middle block under the checkpoint stand-in
  bool twice = false;       // apply the middle block twice (two separate recomputes)
  int micro_batches = 1;    // backward passes per step
};

// Linear -> tanh -> block (Linear -> tanh, maybe checkpointed, maybe twice) -> dropout -> Linear.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(NetConfig c) : cfg(c) {
    a = register_module("a", torch::nn::Linear(6, 16));
    b = register_module("b", torch::nn::Linear(16, 16));
    c_ = register_module("c", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(a(x));
    h = block(h);
    if (cfg.twice) h = block(h);
    return c_(torch::dropout(h, 0.2, is_training()));
  }
  torch::Tensor block(const torch::Tensor& h) {
    return cfg.checkpoint ? CheckpointStandIn::apply(h, &block_fn) : block_fn(h);
  }
  NetConfig cfg;
  torch::nn::Linear a{nullptr}, b{nullptr}, c_{nullptr};
  LayerFn block_fn = [this](const torch::Tensor& h) { return torch::tanh(b(h)); };
};
TORCH_MODULE(Net);

inline Net make_net(NetConfig cfg) {
  torch::manual_seed(7);
  return Net(cfg);
}

// Step `step`'s data and forward + backward for every micro-batch (loss scaled by 1/M).
inline void forward_backward(Net& net, int step) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({8, 6});
  auto y = torch::randn({8, 3});
  const int m = net->cfg.micro_batches;
  auto xs = x.chunk(m);
  auto ys = y.chunk(m);
  for (int i = 0; i < m; ++i) {
    auto loss = torch::mse_loss(net->forward(xs[i]), ys[i]) / m;
    loss.backward();
  }
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

inline bool all_grads_empty(const std::vector<torch::Tensor>& params) {
  return std::all_of(params.begin(), params.end(),
                     [](const auto& p) { return !p.grad().defined(); });
}

// `steps` steps with the unfused optimizer: backward per micro-batch, then step and zero_grad.
template <class Options>
Net train_unfused(Options options, NetConfig cfg, int steps = 10) {
  auto net = make_net(cfg);
  typename stagewise::optim::optimizer_for<Options>::type opt(net->parameters(), options);
  for (int s = 0; s < steps; ++s) {
    forward_backward(net, s);
    opt.step();
    opt.zero_grad();
  }
  return net;
}

}  // namespace test
