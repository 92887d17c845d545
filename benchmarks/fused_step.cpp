// fused_step: peak tensor memory and step time of the optimizer step fused into backward,
// against the standard step (backward, optimizer.step(), gradients set to none).
//   ./bazelw run -c opt //benchmarks:fused_step [-- --threads N] [-- --blas=openblas]
// Model: 8 x Linear(1024, 1024) with ReLU between, batch 64, fp32, MSE loss; SGD (no momentum)
// and Adam. Memory: every live CPU tensor byte (counting allocator), parameters and optimizer
// state included. Time: median step time; "no step" (forward and backward only), standard and
// fused alternate in rounds so that load from other processes hits all alike; ratios are taken
// round by round and printed as median [min, max]. The scaler row: Adam fused and clipped
// (clip_grad_norm_step, two passes) with and without an amp::GradScaler, whose unscale and
// inf/NaN check ride the norm pass. The offload rows: Adam fused with its whole state in a
// runtime::HostStore (runtime::OffloadedState: stepped on host threads beside backward) against
// the fused step with the state on the device, time in alternating rounds (offload_step_ratio);
// and the bytes the stepping thread holds at its peak per parameter (MemoryMeter: parameters,
// gradients, the state and temporaries it holds; at a batch of 8 rows, whose activations are
// 1.5% of the parameters), for plain Adam, fused Adam, and fused Adam with the state offloaded
// (state_bytes_per_param). The header prints the conditions (BLAS loaded, load average, ...); the
// last line is the summary.
#include "benchmarks/common/blas.hpp"
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/stats.hpp"
#include "benchmarks/common/timing.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <thread>
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

// CPU time of the calling thread. With one intra-op thread all of a CPU step runs on it (autograd
// runs CPU backward on the caller), and unlike wall time it does not grow while other processes
// hold the core, so it is the steadier measure on a shared machine.
double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

struct Times {
  bench::Summary wall_us[3];  // no step, standard, fused: spread over the rounds
  bench::Summary cpu_us[3];
  bench::Summary wall_ratio, cpu_ratio;  // fused / standard, one ratio per round
};

// Alternating rounds of the three; each round takes median_us of 3 steps (after 1 warm-up) and
// the thread CPU time of the same steps. Ratios are medians of the rounds' ratios.
Times measure_time(const std::string& kind, int rounds) {
  std::vector<std::unique_ptr<Setup>> setups;
  for (Mode mode : {Mode::no_step, Mode::standard, Mode::fused}) {
    setups.push_back(std::make_unique<Setup>(kind, mode));
  }
  std::vector<double> wall[3], cpu[3], wall_ratio, cpu_ratio;
  for (int r = 0; r < rounds; ++r) {
    for (int m = 0; m < 3; ++m) {
      std::vector<double> calls;
      auto timed = [&] {
        const double t0 = thread_cpu_us();
        setups[m]->step();
        calls.push_back(thread_cpu_us() - t0);
      };
      wall[m].push_back(bench::median_us(timed, 3, 1));
      calls.erase(calls.begin());  // the warm-up
      cpu[m].push_back(median(calls));
    }
    wall_ratio.push_back(wall[2].back() / wall[1].back());
    cpu_ratio.push_back(cpu[2].back() / cpu[1].back());
  }
  Times t;
  for (int m = 0; m < 3; ++m) {
    t.wall_us[m] = bench::summarize(wall[m]);
    t.cpu_us[m] = bench::summarize(cpu[m]);
  }
  t.wall_ratio = bench::summarize(wall_ratio);
  t.cpu_ratio = bench::summarize(cpu_ratio);
  return t;
}

// The fused, clipped Adam step (clip_grad_norm_step's two passes), with or without a scaler.
struct ClippedSetup {
  torch::nn::Sequential mlp = make_mlp();
  torch::Tensor x = torch::randn({kBatch, kWidth});
  torch::Tensor y = torch::randn({kBatch, kWidth});
  sw::optim::FusedStep fused{mlp->parameters(), torch::optim::AdamOptions(1e-4)};
  std::unique_ptr<sw::amp::GradScaler> scaler;

  explicit ClippedSetup(bool scaled) {
    if (scaled) scaler = std::make_unique<sw::amp::GradScaler>();
    step();  // the optimizer state, and the scaler's scale
  }
  void step() {
    auto closure = [this] { return torch::mse_loss(mlp->forward(x), y); };
    if (scaler) {
      sw::optim::clip_grad_norm_step(fused, closure, 1.0, *scaler);
      scaler->update();
    } else {
      sw::optim::clip_grad_norm_step(fused, closure, 1.0);
    }
    fused.finish_step();
  }
};

// Alternating rounds of the clipped step without and with the scaler: the wall time (and the
// thread's CPU time) of one step after a warm-up each round; prints the table and returns the
// per-round ratios of wall time (scaled / plain).
bench::Summary measure_scaler(int rounds) {
  ClippedSetup plain(false), scaled(true);
  ClippedSetup* setups[2] = {&plain, &scaled};
  std::vector<double> wall[2], cpu[2], ratio, cpu_ratio;
  for (int r = 0; r < rounds; ++r) {
    for (int m = 0; m < 2; ++m) {
      double spent = 0;
      wall[m].push_back(bench::median_us(
          [&] {
            const double t0 = thread_cpu_us();
            setups[m]->step();
            spent = thread_cpu_us() - t0;
          },
          1, 1));
      cpu[m].push_back(spent);
    }
    ratio.push_back(wall[1].back() / wall[0].back());
    cpu_ratio.push_back(cpu[1].back() / cpu[0].back());
  }
  const char* rows[2] = {"clipped", "+scaler"};
  for (int m = 0; m < 2; ++m) {
    const auto w = bench::summarize(wall[m]);
    std::printf("%-5s %-9s %11s %10s %15s %9.1f %9.1f %9.1f %9.1f\n", "adam", rows[m], "", "", "",
                w.min / 1000, w.median / 1000, w.max / 1000, bench::summarize(cpu[m]).median / 1000);
  }
  const auto t = bench::summarize(ratio), c = bench::summarize(cpu_ratio);
  std::printf(
      "adam  scaler: fused clipped step with / without amp::GradScaler, wall time %.3f [%.3f, "
      "%.3f], cpu time %.3f [%.3f, %.3f] (median [min, max] of %d alternating rounds)\n",
      t.median, t.min, t.max, c.median, c.min, c.max, rounds);
  return t;
}

// The fused Adam step, its state on the device or (offload) all in a HostStore, at `batch` rows.
struct OffloadSetup {
  torch::nn::Sequential mlp = make_mlp();
  torch::Tensor x, y;
  sw::optim::FusedStep fused{mlp->parameters(), torch::optim::AdamOptions(1e-4)};

  OffloadSetup(bool offload, int batch) : x(torch::randn({batch, kWidth})), y(torch::randn({batch, kWidth})) {
    if (offload) fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
    step();  // the optimizer state
    step();
  }
  void step() {
    torch::mse_loss(mlp->forward(x), y).backward();
    fused.finish_step();  // the offloaded parameters take their updates here
  }
};

// Bytes per parameter the stepping (this) thread holds at its peak in one step at 8 rows: plain
// Adam (standard step), fused Adam, fused Adam with its state offloaded.
std::vector<double> state_bytes_per_param() {
  auto& meter = sw::MemoryMeter::install();
  const double params = static_cast<double>(kLayers) * kWidth * (kWidth + 1);
  std::vector<double> out;
  const auto me = std::this_thread::get_id();
  {
    Setup standard("adam", Mode::standard);
    standard.x = torch::randn({8, kWidth});
    standard.y = torch::randn({8, kWidth});
    meter.reset_peak();
    standard.step();
    out.push_back(static_cast<double>(meter.peak_of(me)) / params);
  }
  for (bool offload : {false, true}) {
    OffloadSetup s(offload, 8);
    meter.reset_peak();
    s.step();
    out.push_back(static_cast<double>(meter.peak_of(me)) / params);
  }
  return out;
}

// Alternating rounds of the fused Adam step with the state on the device and offloaded, at the
// benchmark's batch: per-round ratios of wall time (offloaded / on the device).
bench::Summary measure_offload(int rounds) {
  OffloadSetup on_device(false, kBatch), offloaded(true, kBatch);
  OffloadSetup* setups[2] = {&on_device, &offloaded};
  std::vector<double> wall[2], ratio;
  for (int r = 0; r < rounds; ++r) {
    for (int m = 0; m < 2; ++m) wall[m].push_back(bench::median_us([&] { setups[m]->step(); }, 3, 1));
    ratio.push_back(wall[1].back() / wall[0].back());
  }
  const char* rows[2] = {"fused", "+offload"};
  for (int m = 0; m < 2; ++m) {
    const auto w = bench::summarize(wall[m]);
    std::printf("%-5s %-9s %11s %10s %15s %9.1f %9.1f %9.1f %9s\n", "adam", rows[m], "", "", "",
                w.min / 1000, w.median / 1000, w.max / 1000, "");
  }
  const auto t = bench::summarize(ratio);
  std::printf("adam  offload: fused step with the whole state in a HostStore / on the device, wall "
              "time %.3f [%.3f, %.3f] (median [min, max] of %d alternating rounds)\n",
              t.median, t.min, t.max, rounds);
  return t;
}

double mib(long long bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  bench::select_blas(argc, argv);
  int threads = 1;
  int rounds = 11;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0) threads = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::stoi(argv[i + 1]);
  }
  for (int i = 1; i < argc; ++i) {  // the --name=value forms, as tools/bench_report writes them
    if (std::strncmp(argv[i], "--threads=", 10) == 0) threads = std::stoi(argv[i] + 10);
    if (std::strncmp(argv[i], "--rounds=", 9) == 0) rounds = std::stoi(argv[i] + 9);
  }
  bench::counting_allocator();  // before any tensor exists
  at::set_num_threads(threads);
  const bench::Conditions conditions("fused_step");
  std::printf(
      "fused step vs standard step: %d x Linear(%d, %d), batch %d, fp32, %d intra-op "
      "thread(s)\n",
      kLayers, kWidth, kWidth, kBatch, threads);
  std::printf("%-5s %-9s %11s %10s %15s %9s %9s %9s %9s\n", "optim", "step", "before_MiB",
              "peak_MiB", "step_extra_MiB", "wall_min", "wall_ms", "wall_max", "cpu_ms");
  double peak_ratio[2] = {0, 0};
  double adam_time_ratio = 0;
  const char* kinds[2] = {"sgd", "adam"};
  const char* rows[3] = {"no step", "standard", "fused"};
  for (int k = 0; k < 2; ++k) {
    const std::string kind = kinds[k];
    Memory memory[3];
    for (int m = 0; m < 3; ++m) memory[m] = measure_memory(kind, static_cast<Mode>(m));
    const Times t = measure_time(kind, rounds);
    for (int m = 0; m < 3; ++m) {
      std::printf("%-5s %-9s %11.1f %10.1f %15.1f %9.1f %9.1f %9.1f %9.1f\n", kind.c_str(), rows[m],
                  mib(memory[m].before), mib(memory[m].peak),
                  mib(memory[m].peak - memory[m].before), t.wall_us[m].min / 1000,
                  t.wall_us[m].median / 1000, t.wall_us[m].max / 1000, t.cpu_us[m].median / 1000);
    }
    peak_ratio[k] = static_cast<double>(memory[2].peak) / static_cast<double>(memory[1].peak);
    std::printf(
        "%-5s fused/standard: peak %.3f, wall time %.3f [%.3f, %.3f], cpu time %.3f [%.3f, "
        "%.3f] (median [min, max] of %d alternating rounds); cpu over forward+backward: "
        "standard %+.1f ms, fused %+.1f ms\n",
        kind.c_str(), peak_ratio[k], t.wall_ratio.median, t.wall_ratio.min, t.wall_ratio.max,
        t.cpu_ratio.median, t.cpu_ratio.min, t.cpu_ratio.max, rounds,
        (t.cpu_us[1].median - t.cpu_us[0].median) / 1000,
        (t.cpu_us[2].median - t.cpu_us[0].median) / 1000);
    if (kind == "adam") adam_time_ratio = t.wall_ratio.median;
  }
  const bench::Summary scaler = measure_scaler(rounds);
  const bench::Summary offload = measure_offload(rounds);
  const auto per_param = state_bytes_per_param();
  std::printf("adam  bytes per parameter the stepping thread holds at its peak (8 rows): standard "
              "%.2f, fused %.2f, fused + state offloaded %.2f\n",
              per_param[0], per_param[1], per_param[2]);
  conditions.print_end();
  std::printf(
      "fused_step sgd_peak_ratio=%.3f adam_peak_ratio=%.3f time_ratio=%.3f "
      "scaler_time_ratio=%.3f state_bytes_per_param=%.2f offload_step_ratio=%.3f\n",
      peak_ratio[0], peak_ratio[1], adam_time_ratio, scaler.median, per_param[2], offload.median);
  return 0;
}
