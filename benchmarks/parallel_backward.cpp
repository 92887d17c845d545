// parallel_backward: forward+backward time of N independent branches, one after another versus
// with stagewise::parallel_branches, in alternating rounds.
//   ./bazelw run -c opt //benchmarks:parallel_backward [-- --blas=openblas]
// Each branch is Linear(512,512), ReLU, Linear(512,512) on its own batch of 128 rows; intra-op
// threads are 1, so any speed-up comes from running branches on different cores. Prints the
// conditions, a table with the spread, then the summary line
// `parallel_backward speedup_2=<x> speedup_4=<y>` (medians of the per-round ratios).
#include <stagewise/stagewise.hpp>

#include "benchmarks/common/blas.hpp"
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/rounds.hpp"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <cstdio>
#include <thread>
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

// Sequential and parallel steps alternate round by round, so that load from other processes, if
// any, hits both alike. Returns the spread of the per-round speed-ups.
sw::bench::Summary measure(Setup& setup, int branches, int rounds, int warmup) {
  sw::bench::Rounds r(rounds, /*calls=*/1, warmup);
  r.add("sequential", [&] { setup.sequential_step(); });
  r.add("parallel_branches", [&] { setup.parallel_step(); });
  r.run();
  std::printf("%d branches\n", branches);
  r.print();
  const auto speedup = r.wall_ratio("sequential", "parallel_branches");
  sw::bench::print_figure("speed-up (per-round wall ratio)", speedup, "x");
  return speedup;
}

}  // namespace

int main(int argc, char** argv) {
  sw::bench::select_blas(argc, argv);
  at::set_num_threads(1);
  torch::manual_seed(0);
  sw::bench::Conditions conditions("parallel_backward");
  std::printf(
      "parallel_backward: N x [Linear(512,512), ReLU, Linear(512,512)], batch 128, "
      "intra-op threads %d, pool size %zu, hardware threads %u, 15 alternating rounds\n",
      at::get_num_threads(), sw::default_thread_pool()->size(),
      std::thread::hardware_concurrency());
  double speedup[2] = {0, 0};
  const int counts[2] = {2, 4};
  for (int k = 0; k < 2; ++k) {
    Setup setup(counts[k]);
    speedup[k] = measure(setup, counts[k], /*rounds=*/15, /*warmup=*/3).median;
  }
  conditions.print_end();
  std::printf("parallel_backward speedup_2=%.2f speedup_4=%.2f\n", speedup[0], speedup[1]);
  return 0;
}
