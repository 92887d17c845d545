// unet: skip connections across pipeline stages. Each encoder block stashes its features, the
// decoder block of the same level pops them, possibly in another stage. One block type serves
// every level: the level is the skip's namespace.
//   ./bazelw run //examples:unet
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <cstdio>

namespace sw = stagewise;

struct Level1 {};  // skip namespaces: tag types, one per U-Net level
struct Level2 {};
template <class Level>
using features = sw::skip<Level, "features">;

template <class Level>
struct DownImpl : sw::Skippable<DownImpl<Level>, sw::stashes<features<Level>>> {
  DownImpl(int64_t in, int64_t out)
      : conv(this->register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(conv(x));
    sw::stash<features<Level>>(this, h);  // kept for UpImpl<Level>; compile error if undeclared
    return torch::max_pool2d(h, 2);
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Down = torch::nn::ModuleHolder<DownImpl<Level>>;

template <class Level>
struct UpImpl : sw::Skippable<UpImpl<Level>, sw::pops<features<Level>>> {
  UpImpl(int64_t in, int64_t skip, int64_t out)
      : conv(this->register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in + skip, out, 3).padding(1)))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto up = torch::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
    return torch::relu(conv(torch::cat({up, sw::pop<features<Level>>(this)}, 1)));
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Up = torch::nn::ModuleHolder<UpImpl<Level>>;

int main() {
  torch::manual_seed(0);
  Down<Level1> d1(3, 8);
  Down<Level2> d2(8, 16);  // a second Down<Level1> here would not compile: stashed twice
  torch::nn::Conv2d mid(torch::nn::Conv2dOptions(16, 16, 3).padding(1));
  Up<Level2> u2(16, 16, 8);
  Up<Level1> u1(8, 8, 8);
  torch::nn::Conv2d head(torch::nn::Conv2dOptions(8, 1, 1));

  // The unsplit model: outside a pipe, stash and pop use this thread's plain tracker.
  auto x = torch::randn({16, 3, 32, 32}, torch::requires_grad());
  auto expected = head(u1(u2(mid(d2(d1(x))))));
  expected.pow(2).mean().backward();
  const auto expected_grad = x.grad().clone();

  bool ok = true;
  auto compare = [&](const char* split, auto make_pipe) {
    for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
      auto pipe = make_pipe(sw::PipeOptions().chunks(4).checkpoint(mode));
      x.mutable_grad().reset();
      auto y = pipe->forward(x);  // skips cross stages through portals
      y.pow(2).mean().backward();
      const bool same = torch::allclose(y, expected, 1e-5, 1e-6) &&
                        torch::allclose(x.grad(), expected_grad, 1e-5, 1e-6);
      std::printf("%-8s checkpoint %-11s output and input gradient match unsplit: %s\n", split,
                  sw::to_string(mode), same ? "yes" : "NO");
      ok = ok && same;
    }
  };
  // The stage lists are types: Pipe checks at compile time that every pop has its stash.
  compare("1 stage",
          [&](auto o) { return sw::Pipe(sw::stages(sw::seq(d1, d2, mid, u2, u1, head)), o); });
  compare("2 stages", [&](auto o) {
    return sw::Pipe(sw::stages(sw::seq(d1, d2, mid), sw::seq(u2, u1, head)), o);
  });
  compare("3 stages", [&](auto o) {
    return sw::Pipe(sw::stages(sw::seq(d1, d2), sw::seq(mid, u2), sw::seq(u1, head)), o);
  });

  // A few training steps on 3 stages: forward and backward run on the stage workers.
  auto pipe = sw::Pipe(sw::stages(sw::seq(d1, d2), sw::seq(mid, u2), sw::seq(u1, head)),
                       sw::PipeOptions().chunks(4));
  torch::optim::SGD optimizer(pipe->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto input = x.detach();
  auto target = (input.mean(1, /*keepdim=*/true) > 0).to(torch::kFloat);  // a toy segmentation
  auto bce = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::binary_cross_entropy_with_logits(out, t);
  };
  float first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    optimizer.zero_grad();
    last = pipe->train_step(input, target, bce).item<float>();
    optimizer.step();
    if (step == 0) first = last;
    std::printf("step %d loss %.4f\n", step, last);
  }
  ok = ok && last < first;
  std::printf("%s\n", ok ? "unet: all splits match the unsplit model, and the loss went down"
                         : "unet: MISMATCH");
  return ok ? 0 : 1;
}
