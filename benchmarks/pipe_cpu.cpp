// pipe_cpu: stagewise's pipeline on CPU against the same model run sequentially, against PyTorch's
// old torch.distributed.pipeline.sync.Pipe (benchmarks/anchors/torch_pipe.py) and against
// torch.distributed.pipelining (benchmarks/anchors/torch_pipelining.py, where PyTorch >= 2.4 is
// found). Every figure is defined in docs/benchmarks.md.
//   ./bazelw run -c opt //benchmarks:pipe_cpu [-- --blas=openblas] [-- --rounds N]
//   [-- --overhead-only]  (sections (a)-(c) only)
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/blas.hpp"
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/cpu_time.hpp"
#include "benchmarks/common/flags.hpp"
#include "benchmarks/common/key_values.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/rounds.hpp"
#include "benchmarks/common/stats.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

namespace sw = stagewise;
namespace bench = stagewise::bench;

namespace {

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

// Forward and backward over the micro-batches one after another, as the pipe splits them.
template <class Model>
void microbatch_loop(Model& model, const torch::Tensor& x, const torch::Tensor& t, int64_t chunks) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    (mse(model(xs[i]), ts[i]) * (double(xs[i].size(0)) / double(x.size(0)))).backward();
  }
}

void row(const std::string& what, double value, const std::string& unit) {
  std::printf("  %-52s %10.3f %s\n", what.c_str(), value, unit.c_str());
}

std::string fmt(double v) {
  return stagewise::bench::fixed3(v);
}

// Two stages of [Linear(w,w), ReLU] x 2: the speed configurations.
struct TwoStages {
  torch::nn::Sequential s0, s1;
  explicit TwoStages(int64_t w) : s0(block(w)), s1(block(w)) {}
  static torch::nn::Sequential block(int64_t w) {
    return torch::nn::Sequential(torch::nn::Linear(w, w), torch::nn::ReLU(),
                                 torch::nn::Linear(w, w), torch::nn::ReLU());
  }
  torch::Tensor operator()(const torch::Tensor& x) { return s1->forward(s0->forward(x)); }
};

// Whole batch, whole batch on 2 threads, micro-batch loop and train_step, alternating. With
// `schedules`, train_step also runs ZB-H1 on the same 2 stages and ZB-V on the same layers cut
// into 4 stages in a V on 2 workers, and `zbh1_vs_whole` is ZB-H1's ratio (else GPipe's).
struct SpeedResult {
  bench::Summary vs_whole, vs_whole_2threads, vs_loop, whole_us, pipe_us;
  bench::Summary zbh1_vs_whole;
};

constexpr const char* kGpipe = "stagewise train_step, 2 workers x 1 thread";
constexpr const char* kZbh1 = "train_step ZB-H1, 2 stages";
constexpr const char* kZbv = "train_step ZB-V, 4 stages on 2 workers";

SpeedResult speed(const char* title, int64_t width, int64_t batch, int64_t chunks, int rounds,
                  int calls, bool schedules = false) {
  torch::manual_seed(0);
  TwoStages model(width);
  const auto options = sw::PipeOptions().chunks(chunks).checkpoint("never");
  auto pipe = sw::Pipe(sw::stages(model.s0, model.s1), options);
  auto x = torch::randn({batch, width});
  auto t = torch::randn({batch, width});
  bench::Rounds r(rounds, calls);
  r.add("whole batch, 1 thread", [&] { mse(model(x), t).backward(); });
  r.add("whole batch, 2 threads", [&] {
    at::set_num_threads(2);
    bench::set_blas_threads(2);
    mse(model(x), t).backward();
    bench::set_blas_threads(1);
    at::set_num_threads(1);
  });
  r.add("micro-batch loop, 1 thread", [&] { microbatch_loop(model, x, t, chunks); });
  r.add(kGpipe, [&] { pipe->train_step(x, t, mse); });
  if (schedules) {
    r.add(kZbh1, [&] { pipe->train_step(x, t, mse, sw::schedule::zero_bubble_h1{}); });
    // The same modules (so the same parameters), one [Linear, ReLU] per stage.
    torch::nn::Sequential layers;
    for (const auto& half : {model.s0, model.s1}) {
      for (const auto& m : *half) layers->push_back(m);
    }
    r.add(kZbv, [&x, &t, pipe_v = sw::Pipe(layers, sw::balance{2, 2, 2, 2}, options)]() mutable {
      pipe_v->train_step(x, t, mse, sw::schedule::zero_bubble_v{});
    });
  }
  r.run();
  std::printf("%s: 2 x [Linear(%lld,%lld), ReLU] x 2, batch %lld, chunks %lld, checkpoint never\n",
              title, static_cast<long long>(width), static_cast<long long>(width),
              static_cast<long long>(batch), static_cast<long long>(chunks));
  r.print();
  SpeedResult out;
  out.vs_whole = r.wall_ratio("whole batch, 1 thread", kGpipe);
  out.vs_whole_2threads = r.wall_ratio("whole batch, 2 threads", kGpipe);
  out.vs_loop = r.wall_ratio("micro-batch loop, 1 thread", kGpipe);
  out.whole_us = r.wall("whole batch, 1 thread");
  out.pipe_us = r.wall(kGpipe);
  bench::print_figure("speed-up vs whole batch, 1 thread", out.vs_whole, "x");
  bench::print_figure("speed-up vs whole batch, 2 threads", out.vs_whole_2threads, "x");
  bench::print_figure("speed-up vs micro-batch loop", out.vs_loop, "x");
  out.zbh1_vs_whole = out.vs_whole;
  if (schedules) {
    out.zbh1_vs_whole = r.wall_ratio("whole batch, 1 thread", kZbh1);
    bench::print_figure("ZB-H1: speed-up vs whole batch, 1 thread", out.zbh1_vs_whole, "x");
    bench::print_figure("ZB-H1: speed-up vs micro-batch loop",
                        r.wall_ratio("micro-batch loop, 1 thread", kZbh1), "x");
    bench::print_figure("ZB-V: speed-up vs whole batch, 1 thread",
                        r.wall_ratio("whole batch, 1 thread", kZbv), "x");
    bench::print_figure("ZB-V: speed-up vs micro-batch loop",
                        r.wall_ratio("micro-batch loop, 1 thread", kZbv), "x");
  }
  return out;
}

// Overhead of a 4-stage pipe of `layer(width)` layers, batch 32, chunks 32, checkpoint never:
// (a) process CPU time of train_step minus that of the micro-batch loop, per F/B action;
// (b) the same in wall time with every thread pinned to one core.
struct Overhead {
  bench::Summary cpu_per_action, pinned_wall_per_action, step_wall_per_action, step_cpu_per_action;
};

constexpr int64_t kStages = 4, kBatch = 32, kChunks = 32;
constexpr double kActions = kStages * kChunks * 2;  // one F and one B per cell

// The overhead configurations: 4 stages of one layer each, batch 32, chunks 32, no checkpointing.
struct OverheadSetup {
  torch::nn::Sequential model;
  sw::Pipe<> pipe{nullptr};
  torch::Tensor x, t;

  template <class Layer>
  OverheadSetup(Layer layer, int64_t width) {
    torch::manual_seed(0);
    for (int i = 0; i < kStages; ++i) model->push_back(layer());
    pipe = sw::Pipe(model, sw::balance{1, 1, 1, 1},
                    sw::PipeOptions().chunks(kChunks).checkpoint("never"));
    x = torch::randn({kBatch, width});
    t = torch::randn({kBatch, width});
  }
  void loop() {
    auto forward = [&](const torch::Tensor& in) { return model->forward(in); };
    microbatch_loop(forward, x, t, kChunks);
  }
  void train_step() { pipe->train_step(x, t, mse); }
};

OverheadSetup linear16() {
  return OverheadSetup([] { return torch::nn::Linear(16, 16); }, 16);
}
OverheadSetup linear1() {
  return OverheadSetup([] { return torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)); },
                       1);
}

Overhead overhead(const char* title, OverheadSetup setup, int rounds) {
  auto& pipe = setup.pipe;
  auto& x = setup.x;
  auto& t = setup.t;
  auto add = [&](bench::Rounds& r) {
    r.add("micro-batch loop", [&] { setup.loop(); });
    r.add("stagewise train_step", [&] { setup.train_step(); });
  };
  bench::Rounds free(rounds, /*calls=*/5);
  add(free);
  free.add("stagewise forward() + backward", [&] { mse(pipe->forward(x), t).backward(); });
  free.run();
  bench::Rounds pinned(rounds, /*calls=*/5);
  add(pinned);
  {
    bench::PinnedToOneCore pin;
    pinned.run();
  }
  std::printf("%s: 4 stages, batch 32, chunks 32, checkpoint never (%d F/B actions a step)\n",
              title, static_cast<int>(kActions));
  free.print();
  std::printf("  pinned to one core:\n");
  pinned.print();
  Overhead o;
  o.cpu_per_action = free.per_round([&](int k) {
    return (free.cpu_samples("stagewise train_step")[k] - free.cpu_samples("micro-batch loop")[k]) /
           kActions;
  });
  o.pinned_wall_per_action = pinned.per_round([&](int k) {
    return (pinned.wall_samples("stagewise train_step")[k] -
            pinned.wall_samples("micro-batch loop")[k]) /
           kActions;
  });
  o.step_wall_per_action = free.per_round(
      [&](int k) { return free.wall_samples("stagewise train_step")[k] / kActions; });
  o.step_cpu_per_action =
      free.per_round([&](int k) { return free.cpu_samples("stagewise train_step")[k] / kActions; });
  return o;
}

// --profile=VARIANT --steps=N: runs only one overhead variant N times (after 2 warm-up steps) and
// prints nothing else, for instruction counts under valgrind (tools/overhead_instructions):
// linear16_loop, linear16_train_step, linear1_loop, linear1_train_step.
int profile(const std::string& variant, int steps) {
  const bool tiny = variant.rfind("linear1_", 0) == 0;
  const bool pipe = variant.size() > 10 && variant.substr(variant.size() - 10) == "train_step";
  TORCH_CHECK(variant.rfind("linear16_", 0) == 0 || tiny, "pipe_cpu --profile: unknown variant '",
              variant,
              "'; write linear16_loop, linear16_train_step, linear1_loop or linear1_train_step");
  OverheadSetup setup = tiny ? linear1() : linear16();
  for (int i = 0; i < steps + 2; ++i) pipe ? setup.train_step() : setup.loop();
  std::printf("pipe_cpu profiled %s steps=%d actions_per_step=%d\n", variant.c_str(), steps,
              static_cast<int>(kActions));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::select_blas(argc, argv);
  // large_speedup_openblas is defined for OpenBLAS only, whether --blas=openblas or the system's.
  const bool openblas = bench::loaded_blas().find("openblas:") != std::string::npos;
  const int rounds = bench::int_flag(argc, argv, "--rounds", 7);
  at::set_num_threads(1);
  if (const auto variant = bench::string_flag(argc, argv, "--profile"); !variant.empty()) {
    return profile(variant, bench::int_flag(argc, argv, "--steps", 20));
  }
  auto& memory = bench::counting_allocator();
  bench::Conditions conditions("pipe_cpu");
  std::printf("pipe_cpu: %d alternating rounds; wall and process CPU time, min / median / max\n",
              rounds);

  const Overhead a = overhead("(a, b) overhead, 4 x Linear(16,16)", linear16(), rounds);
  const Overhead c =
      overhead("(c) scheduling only, 4 x Linear(1,1) without bias", linear1(), rounds);
  std::printf("overhead per F/B action, medians of the per-round values [min, max]\n");
  bench::print_figure("(a) CPU overhead per action", a.cpu_per_action, "us");
  bench::print_figure("(b) wall overhead per action, pinned to one core", a.pinned_wall_per_action,
                      "us");
  bench::print_figure("(c) CPU overhead per action", c.cpu_per_action, "us");
  bench::print_figure("(c) wall overhead per action, pinned to one core", c.pinned_wall_per_action,
                      "us");
  bench::print_figure("(c) train_step wall time per action", c.step_wall_per_action, "us");
  bench::print_figure("(c) train_step CPU time per action", c.step_cpu_per_action, "us");
  if (bench::has_flag(argc, argv,
                      "--overhead-only")) {  // (a)-(c) alone, e.g. before/after a change
    conditions.print_end();
    return 0;
  }

  const SpeedResult b = speed("(d) speed", 512, 128, 8, rounds, /*calls=*/3);
  const SpeedResult large = speed("(e) large, 128-row micro-batches", 768, 1024, 8, rounds, 1,
                                  /*schedules=*/true);

  // (f) memory: 4 stages of 4 x (Linear(512,512), ReLU), batch 256, chunks 8.
  torch::manual_seed(0);
  torch::nn::Sequential deep;
  for (int i = 0; i < 16; ++i) {
    deep->push_back(torch::nn::Linear(512, 512));
    deep->push_back(torch::nn::ReLU());
  }
  auto xm = torch::randn({256, 512});
  auto tm = torch::randn({256, 512});
  std::map<std::string, double> peak;
  for (const char* mode : {"never", "except_last", "always"}) {
    auto pipe =
        sw::Pipe(deep, sw::even_balance(32, 4), sw::PipeOptions().chunks(8).checkpoint(mode));
    pipe->train_step(xm, tm, mse);  // warm-up: gradients exist from here on
    memory.reset_peak();
    const long long base = memory.current();
    pipe->train_step(xm, tm, mse);
    peak[mode] = double(memory.peak() - base);
  }
  std::printf("(f) memory: 16 x (Linear(512,512), ReLU) in 4 stages, batch 256, chunks 8\n");
  for (const char* mode : {"never", "except_last", "always"}) {
    row(std::string("peak tensor memory, checkpoint ") + mode, peak[mode] / (1 << 20), "MiB");
  }
  row("ratio except_last / never", peak["except_last"] / peak["never"], "");
  row("ratio always / never", peak["always"] / peak["never"], "");

  // Anchors: PyTorch's old Pipe (one thread for every CPU partition) and
  // torch.distributed.pipelining (one process per stage over Gloo). Both print their own sequential
  // times for a cross-check.
  const std::string rounds_arg = "--rounds " + std::to_string(rounds);
  const auto pipe_anchor = bench::run_anchor("benchmarks/anchors/torch_pipe.py",
                                             "torch.distributed.pipeline.sync", rounds_arg);
  const auto pipelining = bench::run_anchor("benchmarks/anchors/torch_pipelining.py",
                                            "torch.distributed.pipelining", rounds_arg);
  using bench::value_or_nan;
  std::printf("anchors (nan: not available here; see docs/benchmarks.md)\n");
  row("torch Pipe: (a) CPU overhead per action", value_or_nan(pipe_anchor, "a_cpu_overhead_us"),
      "us");
  row("torch Pipe: (b) pinned wall overhead per action",
      value_or_nan(pipe_anchor, "a_pinned_overhead_us"), "us");
  row("torch Pipe: (d) train step", value_or_nan(pipe_anchor, "d_pipe_us") / 1e3, "ms");
  row("torch Pipe: (d) its own whole batch, 1 thread",
      value_or_nan(pipe_anchor, "d_whole_us") / 1e3, "ms");
  row("pipelining GPipe: (a) CPU overhead per action",
      value_or_nan(pipelining, "a_cpu_overhead_us"), "us");
  row("pipelining GPipe: (b) pinned wall overhead per action",
      value_or_nan(pipelining, "a_pinned_overhead_us"), "us");
  row("pipelining GPipe: (d) train step", value_or_nan(pipelining, "d_pipe_us") / 1e3, "ms");
  row("pipelining GPipe: (d) its own whole batch, 1 thread",
      value_or_nan(pipelining, "d_whole_us") / 1e3, "ms");
  row("pipelining 1F1B: (d) finished (1) or timed out (0)",
      value_or_nan(pipelining, "d_one_f_one_b_finished"), "");
  row("cross-check: torch Pipe's whole batch / C++ whole batch",
      value_or_nan(pipe_anchor, "d_whole_us") / b.whole_us.median, "");
  row("cross-check: pipelining's whole batch / C++ whole batch",
      value_or_nan(pipelining, "d_whole_us") / b.whole_us.median, "");
  const double vs_pipe = value_or_nan(pipe_anchor, "d_pipe_us") / b.pipe_us.median;
  const double vs_pipelining = value_or_nan(pipelining, "d_pipe_us") / b.pipe_us.median;
  row("speed-up vs torch Pipe", vs_pipe, "x");
  row("speed-up vs torch.distributed.pipelining GPipe", vs_pipelining, "x");

  conditions.print_end();
  std::printf(
      "pipe_cpu overhead_us_per_cell=%s speedup_vs_sequential=%s speedup_vs_sequential_2threads=%s "
      "speedup_vs_torch_pipe=%s speedup_vs_torch_pipelining=%s large_speedup_openblas=%s\n",
      fmt(a.cpu_per_action.median).c_str(), fmt(b.vs_whole.median).c_str(),
      fmt(b.vs_whole_2threads.median).c_str(), fmt(vs_pipe).c_str(), fmt(vs_pipelining).c_str(),
      fmt(openblas ? large.zbh1_vs_whole.median : std::nan("")).c_str());
  return 0;
}
