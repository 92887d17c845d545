// quickstart: split a model into pipeline stages and train it with stagewise.
//   ./bazelw run //examples:quickstart
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <chrono>
#include <iostream>

namespace sw = stagewise;

int main() {
  torch::manual_seed(0);
  at::set_num_threads(1);  // one core per stage: the pipeline is the parallelism

  // An ordinary LibTorch model: 8 layers.
  torch::nn::Sequential model(torch::nn::Linear(256, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 10), torch::nn::LogSoftmax(1));

  // Two stages of 4 layers, each on its own worker thread; batches split into 8 micro-batches.
  // Checkpointing keeps only each stage's input and recomputes activations before backward.
  auto pipe = sw::Pipe(model, sw::balance{4, 4},
                       sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));
  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nll_loss(out, target);
  };

  // A toy task: the class is the index of the largest of the first 10 features.
  auto x = torch::randn({256, 256});
  auto y = x.slice(1, 0, 10).argmax(1);

  double first = 0, last = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    auto loss = pipe->train_step(x, y, loss_fn);  // forward and backward on the stage workers
    optimizer.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    if (step % 5 == 0 || step == 29) std::cout << "step " << step << "  loss " << last << "\n";
  }
  const auto t1 = std::chrono::steady_clock::now();

  // The same steps without the pipeline, on one thread.
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    loss_fn(model->forward(x), y).backward();
    optimizer.step();
  }
  const auto t2 = std::chrono::steady_clock::now();
  const double piped = std::chrono::duration<double>(t1 - t0).count();
  const double sequential = std::chrono::duration<double>(t2 - t1).count();
  std::cout << "30 steps: pipelined " << piped << " s, sequential " << sequential
            << " s, speed-up " << sequential / piped << "x on " << pipe->num_stages()
            << " stages\n";

  const bool learned = last < 0.5 * first;
  std::cout << "loss went from " << first << " to " << last << (learned ? " (learning)" : " (NOT learning)")
            << "\n";
  return learned ? 0 : 1;
}
