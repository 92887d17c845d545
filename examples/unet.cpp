// unet: skip connections across pipeline stages. Each encoder block stashes its features, the
// decoder block of the same level pops them, possibly in another stage. One block type serves
// every level: the level is the skip's namespace.
//   ./bazelw run //examples:unet -- --device=cuda   (default auto: the GPUs, else the CPU)
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

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

int main(int argc, char** argv) {
  const std::string flag = argc > 1 ? argv[1] : "--device=auto";
  if (argc > 2 || !flag.starts_with("--device=")) {
    std::fprintf(stderr, "usage: %s [--device=auto|cpu|cuda|cuda:N|cpu,cuda:0,cuda:1]\n", argv[0]);
    return 2;
  }
  // auto: one stage per GPU when there are three, else all on cuda:0, else all on the CPU. A split
  // into fewer stages takes the first devices.
  const auto devices = sw::place_stages(3, flag.substr(9));
  for (std::size_t k = 0; k < 3; ++k) std::printf("stage %zu on %s\n", k, devices[k].str().c_str());
  at::globalContext().setAllowTF32CuDNN(false);  // full fp32 convolutions, to compare with the CPU
  // Debian 13's LibTorch 2.6 gets wrong input gradients from oneDNN's convolution backward
  // (docs/ci.md): ATen's own kernels, for a comparison with the unsplit model that means something.
  at::globalContext().setUserEnabledMkldnn(false);
  torch::manual_seed(0);
  Down<Level1> d1(3, 8);
  Down<Level2> d2(8, 16);  // a second Down<Level1> here would not compile: stashed twice
  torch::nn::Conv2d mid(torch::nn::Conv2dOptions(16, 16, 3).padding(1));
  Up<Level2> u2(16, 16, 8);
  Up<Level1> u1(8, 8, 8);
  torch::nn::Conv2d head(torch::nn::Conv2dOptions(8, 1, 1));

  // The unsplit model, on the CPU: outside a pipe, stash and pop use this thread's plain tracker.
  auto x = torch::randn({16, 3, 32, 32}, torch::requires_grad());
  auto expected = head(u1(u2(mid(d2(d1(x))))));
  const auto expected_grad = torch::autograd::grad({expected.pow(2).mean()}, {x})[0];

  bool ok = true;
  auto compare = [&](const char* split, int stages, auto make_pipe) {
    for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
      auto pipe = make_pipe(sw::PipeOptions().chunks(4).checkpoint(mode).devices(
          std::vector(devices.begin(), devices.begin() + stages)));
      x.mutable_grad().reset();
      // y comes back on the last stage's device, and x's gradient on x's (the CPU).
      auto y = pipe->forward(x);  // skips cross stages through portals
      y.pow(2).mean().backward();
      const bool same = torch::allclose(y.cpu(), expected, 1e-5, 1e-6) &&
                        torch::allclose(x.grad(), expected_grad, 1e-5, 1e-6);
      std::printf("%-8s checkpoint %-11s output and input gradient match unsplit: %s\n", split,
                  sw::to_string(mode), same ? "yes" : "NO");
      ok = ok && same;
      // The next pipe may move a layer to another device; its gradient would not follow.
      for (auto& p : pipe->parameters()) p.mutable_grad().reset();
    }
  };
  // The stage lists are types: Pipe checks at compile time that every pop has its stash.
  compare("1 stage", 1,
          [&](auto o) { return sw::Pipe(sw::stages(sw::seq(d1, d2, mid, u2, u1, head)), o); });
  compare("2 stages", 2, [&](auto o) {
    return sw::Pipe(sw::stages(sw::seq(d1, d2, mid), sw::seq(u2, u1, head)), o);
  });
  compare("3 stages", 3, [&](auto o) {
    return sw::Pipe(sw::stages(sw::seq(d1, d2), sw::seq(mid, u2), sw::seq(u1, head)), o);
  });

  // A few training steps on 3 stages: forward and backward run on the stage workers.
  auto pipe = sw::Pipe(sw::stages(sw::seq(d1, d2), sw::seq(mid, u2), sw::seq(u1, head)),
                       sw::PipeOptions().chunks(4).devices(devices));
  torch::optim::SGD optimizer(pipe->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto input = x.detach();  // on the CPU: the pipe moves micro-batches to stage 0, targets to 2
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
