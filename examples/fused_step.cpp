// fused_step: the optimizer step fused into backward. Each parameter is updated the moment its
// gradient is ready and the gradient is freed at once: training is bit-identical to the usual
// loss.backward(); optimizer.step(); optimizer.zero_grad(), with less memory at peak.
//   ./bazelw run //examples:fused_step
#include "benchmarks/common/memory.hpp"  // a CPU allocator that counts live tensor bytes

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace sw = stagewise;

constexpr int kSteps = 20;
const auto kAdam = torch::optim::AdamOptions(1e-3).weight_decay(1e-4);
double lr_at(int step) {
  return step < kSteps / 2 ? 1e-3 : 5e-4;
}  // a step schedule

struct Run {
  long long peak_bytes;               // model, Adam state, gradients, activations
  std::vector<torch::Tensor> params;  // after training
  bool grads_empty = true;            // after every backward
};

Run train(bool fused_step) {
  auto& memory = stagewise::bench::counting_allocator();
  const long long before = memory.current();
  memory.reset_peak();
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(256, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 10));
  std::unique_ptr<torch::optim::Adam> optimizer;
  std::unique_ptr<sw::optim::FusedStep> fused;  // attach once; then backward also steps
  if (fused_step) {
    fused = std::make_unique<sw::optim::FusedStep>(model->named_parameters(), kAdam);
  } else {
    optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), kAdam);
  }
  Run run{0, {}};
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(100 + step);  // the same batch both ways
    auto x = torch::randn({32, 256});
    auto target = torch::randint(0, 10, {32});
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), target);
    if (fused) {
      fused->set_lr(lr_at(step));  // reaches every per-parameter optimizer
      loss.backward();             // every parameter is updated inside; its .grad is freed
      for (const auto& p : model->parameters()) run.grads_empty &= !p.grad().defined();
      fused->finish_step();  // optional: ends the step; throws if one stepped twice
    } else {
      optimizer->param_groups()[0].options().set_lr(lr_at(step));
      loss.backward();  // all gradients are alive now
      optimizer->step();
      optimizer->zero_grad();
    }
  }
  run.peak_bytes = memory.peak() - before;
  for (const auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

int main() {
  const Run standard = train(false);
  const Run fused = train(true);
  double diff = 0;
  for (size_t i = 0; i < standard.params.size(); ++i) {
    diff = std::max(diff, (standard.params[i] - fused.params[i]).abs().max().item<double>());
  }
  std::printf("peak tensor memory, standard step: %6.2f MiB\n", standard.peak_bytes / 1048576.0);
  std::printf("peak tensor memory, fused step:    %6.2f MiB\n", fused.peak_bytes / 1048576.0);
  std::printf("max |standard - fused| over the parameters after %d steps: %g\n", kSteps, diff);
  std::printf("every .grad empty right after backward: %s\n", fused.grads_empty ? "yes" : "NO");
  return diff == 0 && fused.grads_empty && fused.peak_bytes < standard.peak_bytes ? 0 : 1;
}
