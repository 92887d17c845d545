// skip_memory: a U-Net's skip connections through portals versus the same skips passed as extra
// tuple outputs through every stage (what users write without skip support). 3 stages, chunks 8,
// checkpoint except_last; peak tensor memory of one training step, and its time in alternating
// rounds (median [min, max]).
//   ./bazelw run -c opt //benchmarks:skip_memory
// All stages here share one CPU device, so neither path copies a tensor: these rows are the
// control. What portals save shows where a skip crosses devices or ranks (one copy to the popping
// stage against one copy per intermediate stage); that row needs stages on different ranks
// (the distributed transport) and prints nan until it exists (docs/benchmarks.md).
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/rounds.hpp"

#include <cmath>
#include <cstdio>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>

namespace sw = stagewise;
using torch::Tensor;

namespace {

struct Level1 {};
struct Level2 {};
template <class Level>
using features = sw::skip<Level, "features">;

torch::nn::Conv2d conv3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

// Encoder level: features(x) is the computation, forward adds the stash and the downsampling.
template <class Level>
struct DownImpl : sw::Skippable<DownImpl<Level>, sw::stashes<features<Level>>> {
  DownImpl(int64_t in, int64_t out) : conv(this->register_module("conv", conv3(in, out))) {}
  Tensor features_of(const Tensor& x) { return torch::relu(conv(x)); }
  Tensor forward(Tensor x) {
    auto h = features_of(x);
    sw::stash<features<Level>>(this, h);
    return torch::max_pool2d(h, 2);
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Down = torch::nn::ModuleHolder<DownImpl<Level>>;

// Decoder level: merge(x, skip) is the computation, forward pops the skip.
template <class Level>
struct UpImpl : sw::Skippable<UpImpl<Level>, sw::pops<features<Level>>> {
  UpImpl(int64_t in, int64_t skip, int64_t out)
      : conv(this->register_module("conv", conv3(in + skip, out))) {}
  Tensor merge(const Tensor& x, const Tensor& skip) {
    auto up = torch::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
    return torch::relu(conv(torch::cat({up, skip}, 1)));
  }
  Tensor forward(Tensor x) { return merge(x, sw::pop<features<Level>>(this)); }
  torch::nn::Conv2d conv;
};
template <class Level>
using Up = torch::nn::ModuleHolder<UpImpl<Level>>;

struct Model {
  Down<Level1> d1{3, 32};
  Down<Level2> d2{32, 64};
  torch::nn::Conv2d mid = conv3(64, 64);
  Up<Level2> u2{64, 64, 32};
  Up<Level1> u1{32, 32, 16};
  torch::nn::Conv2d head{torch::nn::Conv2dOptions(16, 1, 1)};
};

using Triple = std::tuple<Tensor, Tensor, Tensor>;
using Pair = std::tuple<Tensor, Tensor>;

void row(const std::string& what, double value, const std::string& unit) {
  std::printf("  %-58s %12.2f %s\n", what.c_str(), value, unit.c_str());
}

}  // namespace

int main() {
  at::set_num_threads(1);
  torch::manual_seed(0);
  sw::bench::Conditions conditions("skip_memory");
  auto& memory = sw::bench::counting_allocator();
  Model m;

  // Portals: each stage is a seq of the layers; the skips are not in the stage interfaces.
  auto portal_pipe =
      sw::Pipe(sw::stages(sw::seq(m.d1, m.d2), sw::seq(m.mid, m.u2), sw::seq(m.u1, m.head)),
               sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));

  // Tuples: the same layers, the skips returned by stage 0 and carried through stage 1.
  auto stage0 = [m](const Tensor& x) mutable -> Triple {
    auto s1 = m.d1->features_of(x);
    auto s2 = m.d2->features_of(torch::max_pool2d(s1, 2));
    return {torch::max_pool2d(s2, 2), s1, s2};
  };
  auto stage1 = [m](const Tensor& h, const Tensor& s1, const Tensor& s2) mutable -> Pair {
    return {m.u2->merge(m.mid(h), s2), s1};
  };
  auto stage2 = [m](const Tensor& h, const Tensor& s1) mutable -> Tensor {
    return m.head(m.u1->merge(h, s1));
  };
  auto tuple_pipe = sw::Pipe(sw::stages(stage0, stage1, stage2),
                             sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));

  auto x = torch::randn({64, 3, 64, 64});
  auto target = torch::randn({64, 1, 64, 64});
  auto forward_step = [&](auto& pipe) {
    return [&] { torch::mse_loss(pipe->forward(x), target).backward(); };
  };
  auto train_step = [&](auto& pipe) {
    return [&] {
      pipe->train_step(x, target,
                       [](const Tensor& o, const Tensor& t) { return torch::mse_loss(o, t); });
    };
  };
  auto peak_of = [&](const std::function<void()>& step) {
    step();  // warm-up: gradients exist from here on
    memory.reset_peak();
    const long long base = memory.current();
    step();
    return double(memory.peak() - base) / (1 << 20);
  };

  // Same results first (the two pipes share every parameter).
  auto params = portal_pipe->parameters();
  auto grads_after = [&](const std::function<void()>& step) {
    for (auto& p : params) p.mutable_grad().reset();
    step();
    std::vector<Tensor> g;
    for (auto& p : params) g.push_back(p.grad().clone());
    return g;
  };
  const auto g_portal = grads_after(forward_step(portal_pipe));
  const auto g_tuple = grads_after(forward_step(tuple_pipe));
  bool same = true;
  for (std::size_t k = 0; k < params.size(); ++k)
    same = same && torch::allclose(g_portal[k], g_tuple[k], 1e-4, 1e-6);

  const double fwd_portal_peak = peak_of(forward_step(portal_pipe));
  const double fwd_tuple_peak = peak_of(forward_step(tuple_pipe));
  const double train_portal_peak = peak_of(train_step(portal_pipe));
  const double train_tuple_peak = peak_of(train_step(tuple_pipe));

  // Alternate the two paths so that load from elsewhere on the machine hits both alike.
  sw::bench::Rounds rounds(/*rounds=*/5, /*calls=*/3);
  rounds.add("forward+backward, portals", forward_step(portal_pipe));
  rounds.add("forward+backward, tuples", forward_step(tuple_pipe));
  rounds.add("train_step, portals", train_step(portal_pipe));
  rounds.add("train_step, tuples", train_step(tuple_pipe));
  rounds.run();
  const auto fwd_ratio = rounds.wall_ratio("forward+backward, portals", "forward+backward, tuples");
  const auto train_ratio = rounds.wall_ratio("train_step, portals", "train_step, tuples");

  std::printf(
      "skip_memory: U-Net (2 levels, 32/64 channels, 64x64), batch 64, 3 stages, chunks 8,\n"
      "checkpoint except_last, 1 intra-op thread per worker\n");
  std::printf("gradients of the two paths equal: %s\n", same ? "yes" : "NO");
  std::printf("control: every stage on one CPU device, nothing copied on either path\n");
  rounds.print();
  std::printf("pipe->forward(x) + backward (torchgpipe style)\n");
  row("peak tensor memory, skips through portals", fwd_portal_peak, "MiB");
  row("peak tensor memory, skips as tuple outputs", fwd_tuple_peak, "MiB");
  sw::bench::print_figure("time ratio portal / tuple (per round)", fwd_ratio, "");
  std::printf("pipe->train_step(x, target, mse)\n");
  row("peak tensor memory, skips sent to the popping stage", train_portal_peak, "MiB");
  row("peak tensor memory, skips as tuple outputs", train_tuple_peak, "MiB");
  row("train_step peak ratio portal / tuple", train_portal_peak / train_tuple_peak, "");
  sw::bench::print_figure("train_step time ratio portal / tuple (per round)", train_ratio, "");
  std::printf(
      "stages on different ranks (skips copied): not measured here, it needs the\n"
      "distributed transport; see docs/benchmarks.md\n");
  row("bytes moved per step, portals / tuples", std::nan(""), "");
  row("peak memory per stage, portals / tuples", std::nan(""), "");
  conditions.print_end();

  std::ostringstream last;
  last << std::fixed << std::setprecision(3)
       << "skip_memory portal_peak_ratio=" << fwd_portal_peak / fwd_tuple_peak
       << " time_ratio=" << fwd_ratio.median;
  std::cout << last.str() << std::endl;
  return same ? 0 : 1;
}
