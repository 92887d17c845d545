// fit: a model and a memory cap in, the fastest pipeline that fits out (plan_pipeline), against
// torchgpipe's way, on examples/gpt's transformer where activations dominate, 4 workers in one
// process (one intra-op thread each):
//   (a) torchgpipe's way: GPipe, checkpoint except_last, Adam, split by time, chunks 8;
//   (b) the plan for the smallest cap plan_pipeline accepts, activations allowed to a FileStore
//       and the optimizer's state off the device (a HostStore: runtime::OffloadedState);
//   (b0) the same with the optimizer's state kept on the device (the plan before #51);
//   (c) the top 5 candidates that fit (b)'s cap, each measured;
//   (d), (e): the same for 1.5 times that cap, where more candidates fit: the simulator's ranking.
// A worker's peak: its stages' parameters, the optimizer's state where the caller's thread made
// it (the unfused optimizer's, on the device), and the most its thread held at once in a step
// (MemoryMeter; state off the device is made and kept by the offload's host threads); the worst
// worker's is reported. Steps alternate in rounds (benchmarks/common/rounds.hpp).
//   ./bazelw run -c opt //benchmarks:fit [-- --rounds=3] [--dim=128] [--context=256] [--batch=16]
// Last line:
//   fit memory_ratio=<b peak / a peak> time_ratio=<b step / a step> cap_respected=<1 if every
//   planned run's measured peak is within its cap> choice_vs_best=<fastest measured of (c) /
//   the plan's measured step> choice_vs_best_loose=<the same for (e) and (d)>
//   memory_ratio_state_on_device=<b0 peak / a peak> time_ratio_state_on_device=<b0 / a step>
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/rounds.hpp"
#include "examples/gpt/model.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace bench = stagewise::bench;

namespace {

int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) {
      return std::max<int64_t>(1, std::atoll(argv[i] + prefix.size()));
    }
  }
  return fallback;
}

double mib(double bytes) { return bytes / (1 << 20); }

// One pipe under test: the model it trains, its step (train_step and the optimizer), the
// schedule's workers, and what was predicted and measured.
struct Run {
  std::string name;
  torch::nn::Sequential model;
  sw::Pipe<> pipe = nullptr;
  std::unique_ptr<sw::optim::FusedStep> fused;
  std::unique_ptr<torch::optim::Optimizer> adam;  // unfused: Adam, or an OffloadedOptimizer
  sw::schedule::any_schedule schedule{sw::schedule::gpipe{}};
  double cap = 0;  // 0: none
  double predicted_peak = 0;
  double predicted_ms = 0;
  double measured_peak = 0;

  void step(const torch::Tensor& x, const torch::Tensor& y) {
    if (fused) {
      pipe->train_step(x, y, gpt::lm_loss, *fused, schedule);
      return;
    }
    pipe->train_step(x, y, gpt::lm_loss, schedule);
    adam->step();
    pipe->zero_grad(/*set_to_none=*/true);
  }

  // The worst worker's peak in one step: each worker's stages' parameters (and the unfused
  // optimizer's state, made on this thread) plus its thread's peak.
  double worst_peak(const torch::Tensor& x, const torch::Tensor& y) {
    auto& meter = sw::MemoryMeter::install();
    meter.reset_peak();
    step(x, y);
    const int n = static_cast<int>(pipe->num_stages());
    double worst = 0;
    for (int w = 0; w < schedule.workers(n); ++w) {
      double held = 0;
      int first = -1;
      for (int j = 0; j < n; ++j) {
        if (schedule.worker_of(j, n) != w) continue;
        if (first < 0) first = j;
        const auto* offloaded = dynamic_cast<const sw::optim::OffloadedOptimizer*>(adam.get());
        const auto params = pipe->parameters();
        for (const auto& p : pipe->named_parameters()) {
          if (p.key().rfind("stage" + std::to_string(j) + ".", 0) != 0) continue;
          held += static_cast<double>(p.value().nbytes());
          if (!adam) continue;
          const auto i = static_cast<std::size_t>(
              std::find_if(params.begin(), params.end(),
                           [&](const torch::Tensor& t) { return t.is_same(p.value()); }) -
              params.begin());
          if (offloaded != nullptr && offloaded->offloaded(i)) continue;  // in the store
          held += 2.0 * static_cast<double>(p.value().nbytes());  // exp_avg, exp_avg_sq
        }
      }
      held += static_cast<double>(meter.peak_of(pipe->stage_thread(static_cast<std::size_t>(first))));
      worst = std::max(worst, held);
    }
    return worst;
  }
};

std::unique_ptr<Run> torchgpipe_way(const gpt::Config& c, const torch::Tensor& x) {
  auto r = std::make_unique<Run>();
  r->name = "(a) torchgpipe's way: gpipe, except_last, chunks 8, split by time";
  r->model = [&] {
    torch::manual_seed(0);
    return gpt::make_model(c);
  }();
  const auto b = sw::balance_by_time(4, r->model, x.narrow(0, 0, x.size(0) / 8));
  r->pipe = sw::Pipe(r->model, b, sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));
  r->adam = std::make_unique<torch::optim::Adam>(r->pipe->parameters(), torch::optim::AdamOptions(1e-3));
  return r;
}

std::unique_ptr<Run> planned(const gpt::Config& c, const std::string& name,
                             const sw::PipelinePlan& plan) {
  auto r = std::make_unique<Run>();
  r->name = name;
  torch::manual_seed(0);
  r->model = gpt::make_model(c);
  r->pipe = sw::Pipe(r->model, plan);
  r->schedule = plan.schedule;
  if (plan.fused_step) {  // the pipe gives it the plan's optimizer offload, if any
    r->fused = std::make_unique<sw::optim::FusedStep>(r->pipe->parameters(),
                                                     torch::optim::AdamOptions(1e-3));
  } else if (r->pipe->resolved_options().optimizer_store) {
    r->adam = std::make_unique<sw::optim::OffloadedOptimizer>(
        r->pipe->named_parameters(), torch::optim::AdamOptions(1e-3), r->pipe->offloaded_state());
  } else {
    r->adam = std::make_unique<torch::optim::Adam>(r->pipe->parameters(), torch::optim::AdamOptions(1e-3));
  }
  r->cap = static_cast<double>(plan.cap);
  r->predicted_peak = plan.peak();
  r->predicted_ms = plan.step_seconds * 1e3;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rounds=", 0) && a.rfind("--dim=", 0) && a.rfind("--context=", 0) &&
        a.rfind("--batch=", 0)) {
      std::fprintf(stderr, "usage: fit [--rounds=3] [--dim=128] [--context=256] [--batch=16]\n");
      return 2;
    }
  }
  sw::MemoryMeter::install();  // before any tensor exists
  at::set_num_threads(1);
  bench::Conditions conditions("fit");
  gpt::Config c;
  c.dim = flag(argc, argv, "dim", 128);
  c.heads = 4;
  c.layers = 4;
  c.context = flag(argc, argv, "context", 256);
  const int64_t batch = flag(argc, argv, "batch", 16);
  const int rounds = static_cast<int>(flag(argc, argv, "rounds", 3));
  torch::manual_seed(1);
  const auto x = torch::randint(1, 256, {batch, c.context}, torch::kLong);
  const auto y = torch::randint(0, 256, {batch, c.context}, torch::kLong);
  std::printf("model: examples/gpt, %lld blocks, dim %lld, %lld heads, context %lld; batch %lld "
              "sequences; 4 workers in one process, Adam\n",
              static_cast<long long>(c.layers), static_cast<long long>(c.dim),
              static_cast<long long>(c.heads), static_cast<long long>(c.context),
              static_cast<long long>(batch));
  const auto dir = std::filesystem::temp_directory_path() / "stagewise_fit";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto on_device =
      sw::PlanOptions().workers(4).rounds(1).store(sw::runtime::FileStore(dir.string()), 1e9);
  const auto options = sw::PlanOptions(on_device).optimizer_store(sw::runtime::HostStore());
  const auto model = [&] {
    torch::manual_seed(0);
    return gpt::make_model(c);
  }();
  // The smallest cap the planner accepts for `o`, from its refusal of 1 byte.
  auto smallest_cap = [&](const sw::PlanOptions& o) -> std::int64_t {
    try {
      (void)sw::plan_pipeline(model, sw::Batch(x), y, gpt::lm_loss,
                              sw::PlanOptions(o).memory_per_worker(1));
    } catch (const c10::Error& e) {
      const std::string text = e.what_without_backtrace();
      const std::string key = "the smallest cap any candidate fits is ";
      return std::atoll(text.c_str() + text.find(key) + key.size());
    }
    return 0;
  };
  // (b): the smallest cap the planner accepts; (b0): the same with the state on the device.
  const std::int64_t smallest = smallest_cap(options);
  const auto plan = sw::plan_pipeline(model, sw::Batch(x), y, gpt::lm_loss,
                                      sw::PlanOptions(options).memory_per_worker(smallest + 1));
  std::printf("%s", plan.report().c_str());
  const auto plan0 = sw::plan_pipeline(
      model, sw::Batch(x), y, gpt::lm_loss,
      sw::PlanOptions(on_device).memory_per_worker(smallest_cap(on_device) + 1));
  std::printf("(b0) with the optimizer's state on the device: %s",
              plan0.report().substr(0, plan0.report().find("candidates")).c_str());
  // (d): the ranking where more candidates fit: the plan for 1.5 times the smallest cap, and the
  // top 5 candidates that fit it.
  const auto loose = sw::plan_pipeline(
      model, sw::Batch(x), y, gpt::lm_loss,
      sw::PlanOptions(options).memory_per_worker(static_cast<std::int64_t>(1.5 * smallest)));
  std::vector<std::unique_ptr<Run>> runs;
  runs.push_back(torchgpipe_way(c, x));
  runs.push_back(planned(c, "(b) the plan", plan));
  runs.push_back(planned(c, "(b0) the plan with the state on the device", plan0));
  auto add_top = [&](const sw::PipelinePlan& p, const std::string& tag) {
    int top = 0;
    for (const auto& cand : p.candidates) {
      if (!cand.fits || !cand.plan || top == 5) continue;
      runs.push_back(planned(c, tag + cand.description, *cand.plan));
      ++top;
    }
  };
  add_top(plan, "(c) ");
  runs.push_back(planned(c, "(d) the plan for 1.5x the cap", loose));
  add_top(loose, "(e) ");
  bench::Rounds r(rounds);
  for (auto& run : runs) {
    Run* p = run.get();
    r.add(p->name, [p, &x, &y] { p->step(x, y); });
  }
  r.run();
  for (auto& run : runs) run->measured_peak = run->worst_peak(x, y);
  std::printf("%-100s %12s %20s %10s %10s %10s\n", "run", "pred. ms", "step ms (median [min, max])",
              "pred. MiB", "peak MiB", "cap MiB");
  bool cap_respected = true;
  double fastest_c = 0, fastest_e = 0;
  for (auto& run : runs) {
    const auto s = r.wall(run->name);
    std::printf("%-100s %12.1f %9.1f [%.1f, %.1f] %10.2f %10.2f %10.2f\n", run->name.c_str(),
                run->predicted_ms, s.median / 1e3, s.min / 1e3, s.max / 1e3, mib(run->predicted_peak),
                mib(run->measured_peak), mib(run->cap));
    if (run->cap > 0 && run->measured_peak > run->cap) cap_respected = false;
    if (run->name.rfind("(c)", 0) == 0) {
      fastest_c = fastest_c == 0 ? s.median : std::min(fastest_c, s.median);
    }
    if (run->name.rfind("(e)", 0) == 0) {
      fastest_e = fastest_e == 0 ? s.median : std::min(fastest_e, s.median);
    }
  }
  const auto a_name = runs[0]->name, b_name = runs[1]->name;
  const auto time = r.wall_ratio(b_name, a_name);
  std::printf("plan / torchgpipe's way: step time %.3f [%.3f, %.3f] over %d rounds\n", time.median,
              time.min, time.max, rounds);
  const auto time0 = r.wall_ratio(runs[2]->name, a_name);
  std::printf("plan with the state on the device / torchgpipe's way: step time %.3f [%.3f, %.3f]\n",
              time0.median, time0.min, time0.max);
  std::filesystem::remove_all(dir);
  const std::string d_name = "(d) the plan for 1.5x the cap";
  std::printf("fit memory_ratio=%.3f time_ratio=%.3f cap_respected=%d choice_vs_best=%.3f "
              "choice_vs_best_loose=%.3f memory_ratio_state_on_device=%.3f "
              "time_ratio_state_on_device=%.3f\n",
              runs[1]->measured_peak / runs[0]->measured_peak, time.median, cap_respected ? 1 : 0,
              fastest_c > 0 ? fastest_c / r.wall(b_name).median : 1.0,
              fastest_e > 0 ? fastest_e / r.wall(d_name).median : 1.0,
              runs[2]->measured_peak / runs[0]->measured_peak, time0.median);
  return 0;
}
