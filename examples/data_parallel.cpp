// data_parallel: any module trained on every rank, each on its share of every batch, gradients
// averaged over the ranks during backward (distributed::DataParallel, over c10d's Gloo).
//   ./bazelw build //examples:data_parallel && tools/launch -n 2 -- bazel-bin/examples/data_parallel
// Every rank runs this same program (tools/launch or torchrun set RANK, WORLD_SIZE, ...).
#include <stagewise/distributed.hpp>

#include <torch/torch.h>

#include <iostream>

namespace sw = stagewise;

int main() {
  at::set_num_threads(1);  // one core per rank: the ranks are the parallelism

  // Any module; rank 0's initial parameters are copied to every rank at construction.
  torch::nn::Sequential model(torch::nn::Linear(256, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 10), torch::nn::LogSoftmax(1));
  sw::distributed::DataParallel dp(model);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));

  // The quickstart's toy task; every rank draws the same global batch (same seed) and trains on
  // its own rows of it (dp.shard).
  torch::manual_seed(0);
  auto x = torch::randn({256, 256});
  auto y = x.slice(1, 0, 10).argmax(1);

  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    // Two micro-steps: the first only accumulates (no_sync), the second's backward averages both.
    const auto xs = dp.shard(x).chunk(2), ys = dp.shard(y).chunk(2);
    double loss = 0;
    {
      auto local = dp.no_sync();
      auto l = torch::nll_loss(dp.forward(xs[0]), ys[0]) / 2;
      l.backward();
      loss += l.item<double>();
    }
    auto l = torch::nll_loss(dp.forward(xs[1]), ys[1]) / 2;
    l.backward();  // returns with every gradient averaged over the ranks
    loss += l.item<double>();
    optimizer.step();  // the same step on every rank
    if (step == 0) first = loss;
    last = loss;
    if (dp.rank() == 0 && (step % 5 == 0 || step == 29)) {
      std::cout << "step " << step << "  loss (rank 0's rows) " << last << "\n";
    }
  }
  const bool learned = last < 0.5 * first;
  std::cout << "rank " << dp.rank() << " of " << dp.world_size() << ": loss went from " << first
            << " to " << last << (learned ? " (learning)" : " (NOT learning)") << "\n";
  return learned ? 0 : 1;
}
