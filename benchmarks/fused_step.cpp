// fused_step: peak tensor memory and step time of the optimizer step fused into backward,
// against the standard step (backward, optimizer.step(), gradients set to none).
//   ./bazelw run -c opt //benchmarks:fused_step [-- --threads N]
// Model: 8 x Linear(1024, 1024) with ReLU between, batch 64, fp32, MSE loss; SGD (no momentum)
// and Adam. Memory: every live CPU tensor byte (counting allocator), parameters and optimizer
// state included. Time: median step time; "no step" (forward and backward only), standard and
// fused alternate in rounds so that load from other processes hits all alike. The last line is
// the summary.
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/timing.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace bench = stagewise::bench;

namespace {

constexpr int kLayers = 8;
constexpr int kWidth = 1024;
constexpr int kBatch = 64;

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  torch::nn::Sequential mlp;
  for (int i = 0; i < kLayers; ++i) {
    mlp->push_back(torch::nn::Linear(kWidth, kWidth));
    if (i + 1 < kLayers) mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

enum class Mode { no_step, standard, fused };

// One training setup: a model, its data and a step function.
struct Setup {
  torch::nn::Sequential mlp = make_mlp();
  torch::Tensor x = torch::randn({kBatch, kWidth});
  torch::Tensor y = torch::randn({kBatch, kWidth});
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // standard
  std::unique_ptr<sw::optim::FusedStep> fused;         // fused
  std::function<void()> step;

  Setup(const std::string& kind, Mode mode) {
    auto factory = kind == "sgd"
                       ? sw::optim::make_optimizer_factory(torch::optim::SGDOptions(1e-3))
                       : sw::optim::make_optimizer_factory(torch::optim::AdamOptions(1e-4));
    auto forward_backward = [this] { torch::mse_loss(mlp->forward(x), y).backward(); };
    if (mode == Mode::no_step) {  // forward and backward only: what both steps add to
      step = [this, forward_backward] {
        forward_backward();
        for (auto& p : mlp->parameters()) p.mutable_grad().reset();
      };
    } else if (mode == Mode::fused) {
      fused = std::make_unique<sw::optim::FusedStep>(mlp->parameters(), factory);
      step = [this, forward_backward] {
        forward_backward();  // every parameter steps inside
        fused->finish_step();
      };
    } else {
      optimizer = factory(mlp->parameters());
      step = [this, forward_backward] {
        forward_backward();
        optimizer->step();
        for (auto& p : mlp->parameters()) p.mutable_grad().reset();  // zero_grad(set_to_none)
      };
    }
    step();  // creates the optimizer state, so the measured steps are steady-state ones
    step();
  }
};

struct Memory {
  long long before = 0;  // parameters, optimizer state, data: alive before the step
  long long peak = 0;    // the most alive at once during the step
};

Memory measure_memory(const std::string& kind, Mode mode) {
  auto& mem = bench::counting_allocator();
  Setup setup(kind, mode);
  Memory m;
  m.before = mem.current();
  mem.reset_peak();
  setup.step();
  m.peak = mem.peak();
  return m;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

struct Times {
  double no_step_us = 0, standard_us = 0, fused_us = 0, ratio = 0;
};

// Alternating rounds of each; the ratio is the median of the rounds' fused/standard ratios.
Times measure_time(const std::string& kind, int rounds) {
  Setup no_step(kind, Mode::no_step);
  Setup standard(kind, Mode::standard);
  Setup fused(kind, Mode::fused);
  std::vector<double> n, s, f, r;
  for (int i = 0; i < rounds; ++i) {
    n.push_back(bench::median_us(no_step.step, 3, 1));
    s.push_back(bench::median_us(standard.step, 3, 1));
    f.push_back(bench::median_us(fused.step, 3, 1));
    r.push_back(f.back() / s.back());
  }
  return {median(n), median(s), median(f), median(r)};
}

double mib(long long bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  int rounds = 9;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0) threads = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::stoi(argv[i + 1]);
  }
  bench::counting_allocator();  // before any tensor exists
  at::set_num_threads(threads);
  std::printf(
      "fused step vs standard step: %d x Linear(%d, %d), batch %d, fp32, %d intra-op "
      "thread(s)\n",
      kLayers, kWidth, kWidth, kBatch, threads);
  std::printf("%-5s %-9s %11s %10s %13s %9s\n", "optim", "step", "before_MiB", "peak_MiB",
              "step_extra_MiB", "step_ms");
  double peak_ratio[2] = {0, 0};
  double adam_time_ratio = 0;
  const char* kinds[2] = {"sgd", "adam"};
  for (int k = 0; k < 2; ++k) {
    const std::string kind = kinds[k];
    const Memory none = measure_memory(kind, Mode::no_step);
    const Memory standard = measure_memory(kind, Mode::standard);
    const Memory fused = measure_memory(kind, Mode::fused);
    const Times t = measure_time(kind, rounds);
    std::printf("%-5s %-9s %11.1f %10.1f %13.1f %9.2f\n", kind.c_str(), "no step", mib(none.before),
                mib(none.peak), mib(none.peak - none.before), t.no_step_us / 1000);
    std::printf("%-5s %-9s %11.1f %10.1f %13.1f %9.2f\n", kind.c_str(), "standard",
                mib(standard.before), mib(standard.peak), mib(standard.peak - standard.before),
                t.standard_us / 1000);
    std::printf("%-5s %-9s %11.1f %10.1f %13.1f %9.2f\n", kind.c_str(), "fused", mib(fused.before),
                mib(fused.peak), mib(fused.peak - fused.before), t.fused_us / 1000);
    peak_ratio[k] = static_cast<double>(fused.peak) / static_cast<double>(standard.peak);
    std::printf(
        "%-5s fused/standard: peak %.3f, time %.3f (median of %d alternating rounds); "
        "time over forward+backward: standard %+.2f ms, fused %+.2f ms\n",
        kind.c_str(), peak_ratio[k], t.ratio, rounds, (t.standard_us - t.no_step_us) / 1000,
        (t.fused_us - t.no_step_us) / 1000);
    if (kind == "adam") adam_time_ratio = t.ratio;
  }
  std::printf("fused_step sgd_peak_ratio=%.3f adam_peak_ratio=%.3f time_ratio=%.3f\n",
              peak_ratio[0], peak_ratio[1], adam_time_ratio);
  return 0;
}
