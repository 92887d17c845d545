// parallel_backward: forward+backward time of N independent branches, one after another versus
// with stagewise::parallel_branches, in one run.
//   ./bazelw run -c opt //benchmarks:parallel_backward
// Each branch is Linear(512,512), ReLU, Linear(512,512) on its own batch of 128 rows; intra-op
// threads are 1, so any speed-up comes from running branches on different cores. Prints a table,
// then the summary line `parallel_backward speedup_2=<x> speedup_4=<y>`.
#include <stagewise/stagewise.hpp>

#include "benchmarks/common/timing.hpp"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

namespace sw = stagewise;

namespace {

struct Setup {
  std::vector<torch::nn::Sequential> branches;
  std::vector<torch::Tensor> inputs;
  std::vector<sw::TensorBranch> callables;

  explicit Setup(int n) {
    for (int i = 0; i < n; ++i) {
      branches.emplace_back(torch::nn::Linear(512, 512), torch::nn::ReLU(),
                            torch::nn::Linear(512, 512));
      inputs.push_back(torch::randn({128, 512}, torch::requires_grad()));
      callables.push_back(
          [net = branches.back()](const torch::Tensor& x) mutable { return net->forward(x); });
    }
  }

  void sequential_step() {
    auto loss = torch::zeros({});
    for (std::size_t i = 0; i < branches.size(); ++i) {
      loss = loss + branches[i]->forward(inputs[i]).sum();
    }
    loss.backward();
  }

  void parallel_step() {
    auto outs = sw::parallel_branches(callables, inputs);
    auto loss = torch::zeros({});
    for (const auto& out : outs) loss = loss + out.sum();
    loss.backward();
  }
};

// Median forward+backward time (microseconds) of both variants. Sequential and parallel steps
// alternate, so that load from other processes, if any, hits both alike.
std::pair<double, double> measure(Setup& setup, int rounds, int warmup) {
  for (int i = 0; i < warmup; ++i) {
    setup.sequential_step();
    setup.parallel_step();
  }
  std::vector<double> seq, par;
  for (int i = 0; i < rounds; ++i) {
    seq.push_back(sw::bench::median_us([&] { setup.sequential_step(); }, 1, 0));
    par.push_back(sw::bench::median_us([&] { setup.parallel_step(); }, 1, 0));
  }
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  return {median(seq), median(par)};
}

}  // namespace

int main() {
  at::set_num_threads(1);
  torch::manual_seed(0);
  std::printf(
      "parallel_backward: N x [Linear(512,512), ReLU, Linear(512,512)], batch 128, "
      "intra-op threads %d, pool size %zu, hardware threads %u\n",
      at::get_num_threads(), sw::default_thread_pool()->size(),
      std::thread::hardware_concurrency());
  std::printf("%9s %16s %16s %9s\n", "branches", "sequential_ms", "parallel_ms", "speedup");
  double speedup[2] = {0, 0};
  const int counts[2] = {2, 4};
  for (int k = 0; k < 2; ++k) {
    Setup setup(counts[k]);
    const auto [seq, par] = measure(setup, /*rounds=*/15, /*warmup=*/3);
    speedup[k] = seq / par;
    std::printf("%9d %16.2f %16.2f %8.2fx\n", counts[k], seq / 1000, par / 1000, speedup[k]);
  }
  std::printf("parallel_backward speedup_2=%.2f speedup_4=%.2f\n", speedup[0], speedup[1]);
  return 0;
}
