// memory: activation offload to a file store on the CPU, and memory budgets. An activation-heavy
// MLP (4 stages of [Linear(256,256), Tanh] x 2, the first layer from 32 features, batch 2048,
// chunks 8: each micro-batch's boundary is 256 KiB, the parameters 2 MiB in all), every
// micro-batch checkpointed: peak tensor bytes of
// a step (the counting allocator, all threads, above the level before it) and its time in
// alternating rounds, with and without offloading the checkpointed inputs to files (GPipe and
// 1F1B); then pipes built with PipeOptions().memory_budget(...) for several budgets, each step's
// measured peak against its budget.
//   ./bazelw run -c opt //benchmarks:memory
// Last line: memory file_offload_peak_ratio=... file_offload_time_ratio=... budget_respected=...
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/rounds.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;

namespace {

constexpr int kInput = 32;  // a narrow input: stage 0's kept inputs are small
constexpr int kWidth = 256;
constexpr int kRows = 2048;
constexpr int kChunks = 8;
const sw::balance kBalance{4, 4, 4, 4};

torch::nn::Sequential model() {
  torch::nn::Sequential s;
  for (int k = 0; k < 8; ++k) {
    s->push_back(torch::nn::Linear(k == 0 ? kInput : kWidth, kWidth));
    s->push_back(torch::nn::Tanh());
  }
  return s;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

struct Setup {
  torch::nn::Sequential net;
  sw::Pipe<> pipe{nullptr};
};

Setup build(sw::PipeOptions options) {
  torch::manual_seed(1);
  Setup s{model()};
  s.pipe = sw::Pipe(s.net, kBalance, options);
  return s;
}

// The peak bytes of one step above what was alive before it (after a step that made the
// gradients).
template <class Schedule>
long long peak_of(sw::Pipe<>& pipe, const torch::Tensor& x, const torch::Tensor& t,
                  const Schedule& s) {
  auto& memory = sw::bench::counting_allocator();
  pipe->train_step(x, t, mse, s);
  const long long before = memory.current();
  memory.reset_peak();
  pipe->train_step(x, t, mse, s);
  return memory.peak() - before;
}

}  // namespace

int main() {
  auto& memory = sw::bench::counting_allocator();
  torch::set_num_threads(1);
  sw::bench::Conditions conditions("memory");
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir =
      std::string(tmp ? tmp : "/tmp") + "/stagewise_memory_bench_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::printf(
      "memory: %d stages of [Linear(%d,%d), Tanh] x 2 (the first from %d), batch %d, "
      "chunks %d, checkpoint always; file store in %s\n",
      static_cast<int>(kBalance.size()), kWidth, kWidth, kInput, kRows, kChunks, dir.c_str());
  torch::manual_seed(2);
  const auto x = torch::randn({kRows, kInput});
  const auto t = torch::randn({kRows, kWidth});

  const auto plain = sw::PipeOptions().chunks(kChunks).checkpoint(sw::Checkpoint::always);
  // Copies are cheap against the compute here: every checkpointed input past stage 0 moves.
  const sw::schedule::OffloadCosts costs{.costs = {.offload = 0.1}};
  auto offloading = sw::PipeOptions(plain).offload(sw::runtime::FileStore(dir), costs);
  Setup gpipe_plain = build(plain), gpipe_file = build(offloading);
  Setup ofob_plain = build(plain), ofob_file = build(offloading);

  const long long g0 = peak_of(gpipe_plain.pipe, x, t, sw::schedule::gpipe{});
  const long long g1 = peak_of(gpipe_file.pipe, x, t, sw::schedule::gpipe{});
  const long long o0 = peak_of(ofob_plain.pipe, x, t, sw::schedule::one_f_one_b{});
  const long long o1 = peak_of(ofob_file.pipe, x, t, sw::schedule::one_f_one_b{});
  std::printf("\npeak tensor bytes of a step (above the level before it)\n");
  std::printf("  %-34s %12lld  without offload\n", "GPipe", g0);
  std::printf("  %-34s %12lld  file offload (ratio %.3f)\n", "GPipe", g1,
              static_cast<double>(g1) / static_cast<double>(g0));
  std::printf("  %-34s %12lld  without offload\n", "1F1B", o0);
  std::printf("  %-34s %12lld  file offload (ratio %.3f)\n", "1F1B", o1,
              static_cast<double>(o1) / static_cast<double>(o0));

  sw::bench::Rounds r(/*rounds=*/5, /*calls=*/1, /*warmup=*/1);
  r.add("GPipe, no offload",
        [&] { gpipe_plain.pipe->train_step(x, t, mse, sw::schedule::gpipe{}); });
  r.add("GPipe, file offload",
        [&] { gpipe_file.pipe->train_step(x, t, mse, sw::schedule::gpipe{}); });
  r.add("1F1B, no offload",
        [&] { ofob_plain.pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{}); });
  r.add("1F1B, file offload",
        [&] { ofob_file.pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{}); });
  r.run();
  std::printf("\nstep time, %d alternating rounds\n", r.rounds());
  r.print();
  const auto gpipe_time = r.wall_ratio("GPipe, file offload", "GPipe, no offload");
  const auto ofob_time = r.wall_ratio("1F1B, file offload", "1F1B, no offload");
  sw::bench::print_figure("GPipe: time with / without offload", gpipe_time, "x");
  sw::bench::print_figure("1F1B: time with / without offload", ofob_time, "x");

  // Budgets: the smallest that GPipe fits, and larger ones; each pipe's measured peak (the
  // fullest worker thread's rise: on the CPU each stage's worker allocates what its cells keep,
  // its outputs included) against its budget, per stage.
  const auto sample = torch::randn({kRows / kChunks, kInput});
  const sw::schedule::any_schedule gpipe("gpipe", sw::schedule::gpipe{});
  const auto stage_memory = sw::profile_stage_memory(model(), kBalance, sample);
  long long smallest = 0;
  try {
    (void)sw::schedule::plan_memory(gpipe, kChunks, stage_memory, 1, true, costs);
  } catch (const c10::Error& e) {
    const std::string text = e.what_without_backtrace();
    smallest = std::stoll(text.substr(text.find("fits is ") + 8));
  }
  std::printf("\nmemory budgets (GPipe, per stage; smallest that fits: %lld bytes)\n", smallest);
  bool respected = smallest > 0;
  for (double scale : {1.0, 1.5, 3.0, 8.0}) {
    const auto budget = static_cast<long long>(static_cast<double>(smallest) * scale);
    // A directory per budget: the pipes above still hold their store's files in `dir`.
    const std::string budget_dir = dir + "/budget_" + std::to_string(budget);
    std::filesystem::create_directories(budget_dir);
    Setup s = build(sw::PipeOptions().chunks(kChunks).memory_budget(
        budget, sample, sw::runtime::FileStore(budget_dir), gpipe));
    s.pipe->train_step(x, t, mse, sw::schedule::gpipe{});
    const auto before = memory.thread_current();
    memory.reset_peak();
    s.pipe->train_step(x, t, mse, sw::schedule::gpipe{});
    const long long measured = memory.max_thread_rise(before);
    const auto& plan = s.pipe->memory_plan();
    const double predicted =
        *std::max_element(plan.predicted_peak.begin(), plan.predicted_peak.end());
    const bool ok = measured <= budget;
    respected = respected && ok;
    std::string modes;
    for (auto mode : plan.checkpoints) modes += std::string(modes.empty() ? "" : ",") +
                                                 sw::to_string(mode);
    std::printf(
        "  budget %10lld: checkpoint %-44s offload %-3s predicted %10.0f measured %10lld %s\n",
        budget, modes.c_str(), plan.offload ? "yes" : "no", predicted, measured,
        ok ? "within" : "OVER");
  }
  std::filesystem::remove_all(dir);
  conditions.print_end();
  std::printf(
      "memory file_offload_peak_ratio=%.3f file_offload_time_ratio=%.3f "
      "budget_respected=%d\n",
      static_cast<double>(g1) / static_cast<double>(g0), gpipe_time.median, respected ? 1 : 0);
  return 0;
}
