// quickstart: split a model into two balanced pipeline stages, train it, and compare the speed
// with the same model trained without the pipeline.
//   ./bazelw run //examples:quickstart -- --device=cuda   (default auto: the GPUs, else the CPU)
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

namespace sw = stagewise;
using torch::nn::Linear;
using torch::nn::ReLU;

int main(int argc, char** argv) {
  const std::string flag = argc > 1 ? argv[1] : "--device=auto";
  if (argc > 2 || !flag.starts_with("--device=")) {
    std::cerr << "usage: " << argv[0] << " [--device=auto|cpu|cuda|cuda:N|cpu,cuda:0]\n";
    return 2;
  }
  // auto: one stage per GPU when there are two, else both on cuda:0, else both on the CPU.
  const auto devices = sw::place_stages(2, flag.substr(9));
  torch::manual_seed(0);
  at::set_num_threads(1);  // one core per stage: the pipeline is the parallelism

  // An ordinary LibTorch model whose layers differ in cost: the widest come first, so an even
  // split by layer count would give the first stage four fifths of the work.
  torch::nn::Sequential model(Linear(256, 512), ReLU(), Linear(512, 512), ReLU(),  //
                              Linear(512, 256), ReLU(), Linear(256, 256), ReLU(),  //
                              Linear(256, 256), ReLU(), Linear(256, 256), ReLU(),  //
                              Linear(256, 10));
  const int64_t rows = 128, chunks = 8;

  // Time every layer on one micro-batch (on copies, on stage 0's device), then split where the
  // stages cost the same.
  const auto balance = sw::balance_by_time(2, model, torch::randn({rows / chunks, 256}),
                                           sw::BalanceOptions().device(devices[0]));
  std::cout << "balance {" << balance[0] << ", " << balance[1] << "}\n";

  // Two stages on their own worker threads; a mini-batch runs as 8 micro-batches. No
  // checkpointing: this model's activations are small, so keep them and skip the recompute. The
  // pipe moves each stage's layers to its device.
  auto pipe =
      sw::Pipe(model, balance,
               sw::PipeOptions().chunks(chunks).checkpoint(sw::Checkpoint::never).devices(devices));
  for (std::size_t k = 0; k < 2; ++k) std::cout << "stage " << k << " on " << devices[k] << "\n";
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nll_loss(torch::log_softmax(out, 1), target);
  };
  // A toy task: the class is the index of the largest of the first 10 features. The data stays on
  // the CPU: the pipe moves each micro-batch to stage 0's device and its target to the last's.
  auto x = torch::randn({rows, 256});
  auto y = x.slice(1, 0, 10).argmax(1);

  double loss = 0;
  auto pipelined = [&] {
    optimizer.zero_grad();
    // forward+backward on the workers; the loss comes back on the last stage's device
    loss = pipe->train_step(x, y, loss_fn).item<double>();
    optimizer.step();
  };
  auto sequential = [&] {  // the same model and step, without the pipeline: stage after stage
    optimizer.zero_grad();
    auto h = x;
    auto layer = model->begin();
    for (std::size_t k = 0; k < balance.size(); ++k) {  // stage k's layers are on devices[k]
      h = h.to(devices[k]);
      for (int64_t i = 0; i < balance[k]; ++i) h = (layer++)->forward(h);
    }
    loss_fn(h, y.to(h.device())).backward();
    optimizer.step();
  };
  auto seconds = [&](auto& step, int steps) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    for (auto d : devices)  // a GPU works after the calls return: wait for it
      if (d.is_cuda()) torch::cuda::synchronize(d.index());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  // Alternate the two in rounds, so that other work on the machine slows both alike.
  pipelined();
  const double first = loss;
  std::vector<double> speedups;
  for (int round = 0; round < 5; ++round) {
    const double p = seconds(pipelined, 4), s = seconds(sequential, 4);
    speedups.push_back(s / p);
    std::cout << "round " << round << "  loss " << loss << "  pipelined " << p * 250
              << " ms/step  sequential " << s * 250 << " ms/step\n";
  }
  std::sort(speedups.begin(), speedups.end());
  std::cout << "speed-up " << speedups[2] << "x on " << pipe->num_stages()
            << " stages (median of 5 rounds, " << speedups.front() << ".." << speedups.back()
            << ")\n";

  const bool learned = loss < 0.7 * first;
  std::cout << "loss went from " << first << " to " << loss
            << (learned ? " (learning)" : " (NOT learning)") << "\n";
  return learned ? 0 : 1;
}
