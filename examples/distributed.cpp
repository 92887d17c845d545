// distributed: the quickstart model with its two stages in two processes, over c10d (Gloo).
//   ./bazelw build //examples:distributed && tools/launch -n 2 -- bazel-bin/examples/distributed
// Every rank runs this same program (tools/launch or torchrun set RANK, WORLD_SIZE, ...).
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <iostream>

namespace sw = stagewise;

int main() {
  torch::manual_seed(0);   // every rank builds the same model: same seed, same layers
  at::set_num_threads(1);  // one core per rank: the pipeline is the parallelism

  torch::nn::Sequential model(torch::nn::Linear(256, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 10), torch::nn::LogSoftmax(1));

  // Rendezvous from the environment; stage 0 (4 layers) lives on rank 0, stage 1 on rank 1.
  // Each rank keeps only its own stage; shapes and world size are checked before any step.
  sw::distributed::Pipe pipe(model, sw::balance{4, 4},
                             sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));
  // Each rank's optimizer updates its own stage's parameters.
  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nll_loss(out, target);
  };

  // The same toy task as the quickstart. Rank 0 needs the input, the last rank the target;
  // here every rank makes both (same seed), which is simplest.
  auto x = torch::randn({256, 256});
  auto y = x.slice(1, 0, 10).argmax(1);

  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    // 1F1B: each rank alternates forwards and backwards; every rank gets the loss back.
    auto loss = pipe->train_step(x, y, loss_fn, sw::schedule::one_f_one_b{});
    optimizer.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    if (pipe->rank() == 0 && (step % 5 == 0 || step == 29)) {
      std::cout << "step " << step << "  loss " << last << "\n";
    }
  }
  const bool learned = last < 0.5 * first;
  std::cout << "rank " << pipe->rank() << " of " << pipe->world_size() << ": loss went from " << first
            << " to " << last << (learned ? " (learning)" : " (NOT learning)") << "\n";
  return learned ? 0 : 1;
}
