// pipe_data_parallel: a pipeline of 2 stages with 2 data-parallel replicas on 4 ranks
// (distributed::Pipe with Options().data_parallel(2), over c10d's Gloo): each replica trains on
// its half of every global batch, and each stage's replicas average its gradients as soon as the
// stage's backward is done.
//   ./bazelw build //examples:pipe_data_parallel &&
//     tools/launch -n 4 -- bazel-bin/examples/pipe_data_parallel
// Every rank runs this same program (tools/launch or torchrun set RANK, WORLD_SIZE, ...).
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <string>

namespace sw = stagewise;

int main(int argc, char** argv) {
  const bool shard = argc > 1 && std::string(argv[1]) == "--shard";
  at::set_num_threads(1);  // one core per rank: the ranks are the parallelism

  // Every rank builds the whole model; each keeps its stage. Replica 0's initial parameters are
  // copied to replica 1 at construction.
  torch::nn::Sequential model(torch::nn::Linear(256, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 10), torch::nn::LogSoftmax(1));
  sw::distributed::Pipe pipe(model, sw::balance{2, 4}, sw::PipeOptions().chunks(4),
                             sw::distributed::Options().data_parallel(2).shard_gradients(shard));
  if (pipe->rank() == 0) std::cout << pipe->layout();
  // Sharded: Adam over this replica's half of its stage's parameters (it sends their new values
  // to the other replica after each step); else over all of them.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (shard) {
    optimizer = std::make_unique<sw::distributed::Sharded<torch::optim::Adam>>(
        pipe, torch::optim::AdamOptions(1e-3));
  } else {
    optimizer =
        std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  }

  // The quickstart's toy task; every rank draws the same global batch (same seed) and its
  // replica trains on its half (shard), given by the first stage's rank (input) and the last's
  // (target).
  torch::manual_seed(0);
  auto x = torch::randn({256, 256});
  auto y = x.slice(1, 0, 10).argmax(1);
  const auto input = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
  const auto target = pipe->has_stage(1) ? pipe->shard(y) : torch::Tensor();
  auto nll = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nll_loss(out, t);
  };

  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    // The loss of the whole global batch; the gradients averaged over the replicas.
    last = pipe->train_step(input, target, nll, sw::schedule::one_f_one_b{}).item<double>();
    optimizer->step();  // the same step in both replicas (sharded: each its half)
    optimizer->zero_grad();
    if (step == 0) first = last;
    if (pipe->rank() == 0 && (step % 5 == 0 || step == 29)) {
      std::cout << "step " << step << "  loss " << last << "\n";
    }
  }
  const bool learned = last < 0.5 * first;
  std::cout << "rank " << pipe->rank() << " (replica " << pipe->replica() << ", stage rank "
            << pipe->pipeline_rank() << "): loss went from " << first << " to " << last
            << (learned ? " (learning)" : " (NOT learning)")
            << (shard ? ", optimizer state for " + std::to_string(optimizer->state().size()) +
                            " of " + std::to_string(pipe->parameters().size()) + " parameters"
                      : std::string())
            << "\n";
  return learned ? 0 : 1;
}
