// pipe_cuda: stagewise's pipeline on one GPU, every stage on the same device, against the same
// layers run unpipelined; the fused optimizer step against the standard one; ParallelBranches of 8
// small experts against the same experts run one after another. Every figure is defined in
// docs/benchmarks.md ("pipe_cuda (GPU)").
//   build/pipe_cuda [--rounds N] [--quick] [--device cuda:N] [--tf32] [--sections abcdefg]
// Needs a CUDA LibTorch and a GPU: without one it exits with code 2 and says so.
//
// (a) large: 16 x (Linear(4096,4096), GELU) in 4 stages of 4 layers, batch 1024, chunks 8 (128-row
//     micro-batches), fp32; (b) small: the same with Linear(512,512). For each: the whole batch,
//     the micro-batch loop (forward+backward per micro-batch, loss weighted by its share of the
//     rows, as a user writes it) and train_step in every checkpoint mode (never, except_last,
//     always) and schedule (GPipe, 1F1B, ZB-H1); (b) also 1F1B with stage 0 on the CPU. Gradients
//     are reset to none at the start of every step. Step time: wall time with
//     torch::cuda::synchronize() around the step, variants alternated in rounds, min / median /
//     max. Peak: the CUDA caching allocator's peak of bytes allocated to tensors during one step
//     (after the rounds), reset just before it; "base" is what was allocated then (parameters,
//     data, optimizer state).
// (c) the large model with Adam: train_step (1F1B, checkpoint never) + Adam::step() + gradients to
//     none, against train_step with Adam fused into backward (optim::FusedStep); the same for the
//     whole batch. Peaks measured with only that variant's optimizer alive.
// (d) 8 small experts [Linear(512,1024), GELU, Linear(1024,512)], 128 rows each: one after
//     another on the caller's thread, against ParallelBranches::forward_each (forward and
//     backward), against ParallelBranches with a pool of one thread (each expert on its own
//     stream, launched one after another), and the forward alone; (d2) the same for experts 16
//     times larger [Linear(2048,8192), GELU, Linear(8192,2048)] with as few rows.
//
// (e) activation offload on an activation-dominated model, 16 x (Linear(2048,2048), GELU) in 4
//     stages, batch 65536, chunks 16 (the boundaries in flight under GPipe, 2 GiB, are 4x the
//     parameters and their gradients): train_step GPipe and 1F1B with checkpoint always, without
//     and with HostStore offload (costs measured: a boundary's copy against a stage's forward),
//     and pipe->forward + backward with except_last (torchgpipe's semantics and default).
// (f) precision: the large model's train_step (1F1B, checkpoint never) + Adam in fp32, under bf16
//     autocast, and under fp16 autocast with an amp::GradScaler (scaled losses, unscale_, the
//     inf/NaN check and the scale's update on the GPU); time and peak as in (c).
// (g) the optimizer's state off the device: the large model's whole batch with Adam fused into
//     backward, its state on the GPU against all of it in a HostStore (runtime::OffloadedState:
//     gradients and values copied to pinned host buffers in the hooks, Adam stepped on the CPU
//     beside backward, the values copied back in finish_step); wall time in alternating rounds,
//     and the GPU bytes per parameter at the step's peak with 8 rows (activations about 0.2% of
//     the parameters).
// The last line is
//   pipe_cuda overhead_vs_loop=X ckpt_always_peak_ratio=Y branches_speedup=Z
//             offload_peak_ratio=P offload_time_ratio=T offload_vs_torchgpipe_peak=Q
//             offload_vs_torchgpipe_time=U fp16_time_ratio=H fp16_peak_ratio=K
//             gpu_offload_step_ratio=O gpu_state_bytes_per_param=S
// overhead_vs_loop: (a) train_step with the 1F1B schedule, checkpoint never / the micro-batch loop,
//   wall time, median of the per-round ratios (goal on an H100: <= 1.02);
// ckpt_always_peak_ratio: (a) peak of train_step 1F1B with checkpoint always / with never;
// branches_speedup: (d) the headline experts one after another / ParallelBranches,
//   forward+backward wall time, median of the per-round ratios (goal on an H100: >= 1.5).
// offload_peak_ratio, offload_time_ratio: (e) GPipe, always: peak and wall time (median of the
//   per-round ratios) with offload / without (goals: <= 0.5 at <= 1.05);
// offload_vs_torchgpipe_peak, _time: (e) GPipe, always, offload / the torchgpipe-style row
//   (goals: <= 0.6 and <= 1.05).
// fp16_time_ratio, fp16_peak_ratio: (f) fp16 + GradScaler / fp32, wall time (median of the
//   per-round ratios) and peak.
// gpu_offload_step_ratio: (g) the fused Adam step with its whole state in a HostStore / on the
//   GPU, wall time, median of the per-round ratios (goal <= 1.15);
// gpu_state_bytes_per_param: (g) the GPU's peak bytes in that step (8 rows) / its parameters
//   (goal <= 4.5 for fp32; 12 and more with the state on the device).
// A phase that does not finish within its time limit (a hang) ends the program with code 3 after
// printing the last line with nan for the figures not measured.
#include <stagewise/stagewise.hpp>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/rounds.hpp"
#include "benchmarks/common/stats.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace bench = stagewise::bench;

namespace {

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

std::string fmt(double v) {
  return stagewise::bench::fixed3(v);
}

void row(const std::string& what, double value, const std::string& unit) {
  std::printf("  %-52s %10.3f %s\n", what.c_str(), value, unit.c_str());
}

double mib(long long bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

// ---- the device ----------------------------------------------------------------------------

// The GPU under test: synchronization and the caching allocator's statistics. Entry 0 of a
// StatArray is StatType::AGGREGATE (all pools); the statistics' header and type moved in LibTorch
// 2.x (c10::CachingDeviceAllocator::DeviceStats) but the calls and the layout did not.
struct Gpu {
  torch::Device device;
  c10::DeviceIndex index;

  void sync() const { torch::cuda::synchronize(index); }
  long long allocated() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
  }
  long long peak() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak;
  }
  void reset_peak() const { c10::cuda::CUDACachingAllocator::resetPeakStats(index); }
  // `fn`, then a wait for the GPU to finish what it queued: a step's wall time covers its work.
  std::function<void()> synced(std::function<void()> fn) const {
    return [fn = std::move(fn), index = index] {
      fn();
      torch::cuda::synchronize(index);
    };
  }
};

// Tensor bytes alive on the GPU just before a step and at the most during it.
struct Peak {
  long long base = 0, peak = 0;
};

// One step of `step` after `prepare` (gradients reset to none): the peak is reset just before.
Peak measure_peak(const Gpu& gpu, const std::function<void()>& prepare,
                  const std::function<void()>& step) {
  prepare();
  gpu.sync();
  Peak p;
  p.base = gpu.allocated();
  gpu.reset_peak();
  step();
  gpu.sync();
  p.peak = gpu.peak();
  return p;
}

void reset_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

// ---- a watchdog for hangs --------------------------------------------------------------------

// Turns a hang into a message: if a phase outlives its limit, `on_expiry(phase)` runs on the
// watchdog's thread and the process ends with code 3.
class Watchdog {
 public:
  explicit Watchdog(std::function<void(const std::string&)> on_expiry)
      : on_expiry_(std::move(on_expiry)), thread_([this] { watch(); }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Starts phase `what`, which must end (the next phase() or the destructor) within `limit`.
  void phase(std::string what, std::chrono::seconds limit) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      what_ = std::move(what);
      limit_ = limit;
      deadline_ = std::chrono::steady_clock::now() + limit;
    }
    wake_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (deadline_ == std::chrono::steady_clock::time_point::max()) {
        wake_.wait(lock);
        continue;
      }
      wake_.wait_until(lock, deadline_);
      if (!stop_ && std::chrono::steady_clock::now() >= deadline_) {
        on_expiry_(what_ + " did not finish within " + std::to_string(limit_.count()) + " s");
        std::fflush(nullptr);
        std::_Exit(3);
      }
    }
  }

  std::function<void(const std::string&)> on_expiry_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::string what_;
  std::chrono::seconds limit_{0};
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  std::thread thread_;  // last: starts once the members it reads exist
};

// ---- (a), (b): whole batch, micro-batch loop, train_step ---------------------------------------

struct Options {
  int rounds = 7;
  bool quick = false;
  bool tf32 = false;
  std::string device = "cuda:0";
  std::string sections = "abcdefg";
};

struct ModelSpec {
  std::string title;
  int64_t width, layers, batch, chunks;
  int calls;  // timed calls per variant and round
};

constexpr int kStages = 4;
constexpr const char* kWhole = "whole batch";
constexpr const char* kLoop = "micro-batch loop";
constexpr const char* kHeadline = "train_step 1F1B, never";
constexpr const char* kAlways = "train_step 1F1B, always";
constexpr const char* kCpuStage = "train_step 1F1B, never, stage 0 on the CPU";

// `layers` x (Linear(width, width), GELU), seeded, on `device`.
torch::nn::Sequential mlp(const ModelSpec& spec, const torch::Device& device) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < spec.layers; ++i) {
    model->push_back(torch::nn::Linear(spec.width, spec.width));
    model->push_back(torch::nn::GELU());
  }
  model->to(device);
  return model;
}

// Forward and backward per micro-batch, one after another, as the pipe splits the batch.
void microbatch_loop(torch::nn::Sequential& model, const torch::Tensor& x, const torch::Tensor& t,
                     int64_t chunks) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    (mse(model->forward(xs[i]), ts[i]) * (double(xs[i].size(0)) / double(x.size(0)))).backward();
  }
}

using ScheduleStep = std::function<void(sw::Pipe<>&, const torch::Tensor&, const torch::Tensor&)>;

const std::vector<std::pair<std::string, ScheduleStep>>& schedules() {
  static const std::vector<std::pair<std::string, ScheduleStep>> all = {
      {"GPipe", [](sw::Pipe<>& p, const torch::Tensor& x,
                   const torch::Tensor& t) { p->train_step(x, t, mse, sw::schedule::gpipe{}); }},
      {"1F1B",
       [](sw::Pipe<>& p, const torch::Tensor& x, const torch::Tensor& t) {
         p->train_step(x, t, mse, sw::schedule::one_f_one_b{});
       }},
      {"ZB-H1",
       [](sw::Pipe<>& p, const torch::Tensor& x, const torch::Tensor& t) {
         p->train_step(x, t, mse, sw::schedule::zero_bubble_h1{});
       }},
  };
  return all;
}

// A section's model on the GPU, its parameters, data and target, the gradients' reset, and the
// pipe's split into kStages stages, all on the GPU.
struct SectionModel {
  torch::nn::Sequential model;
  std::vector<torch::Tensor> params;
  torch::Tensor x, t;
  std::function<void()> reset;
  sw::balance balance;
  std::vector<torch::Device> devices;
};

SectionModel section_model(const ModelSpec& spec, const Gpu& gpu) {
  auto model = mlp(spec, gpu.device);
  auto params = model->parameters();
  return {model,
          params,
          torch::randn({spec.batch, spec.width}, gpu.device),
          torch::randn({spec.batch, spec.width}, gpu.device),
          [params] { reset_grads(params); },
          sw::even_balance(2 * spec.layers, kStages),
          std::vector<torch::Device>(kStages, gpu.device)};
}

struct ModelResult {
  bench::Summary overhead_vs_loop;
  double always_peak_ratio = std::nan("");
};

ModelResult model_section(const char* label, const ModelSpec& spec, const Gpu& gpu,
                          const Options& opt, bool cpu_stage) {
  auto [model, params, x, t, reset, balance, devices] = section_model(spec, gpu);

  std::vector<std::pair<std::string, std::function<void()>>> variants;
  variants.emplace_back(kWhole, [&, reset] {
    reset();
    mse(model->forward(x), t).backward();
  });
  variants.emplace_back(kLoop, [&, reset] {
    reset();
    microbatch_loop(model, x, t, spec.chunks);
  });
  std::vector<sw::Pipe<>> pipes;
  for (const char* mode : {"never", "except_last", "always"}) {
    pipes.push_back(sw::Pipe(
        model, balance, sw::PipeOptions().chunks(spec.chunks).checkpoint(mode).devices(devices)));
    for (const auto& [name, run] : schedules()) {
      variants.emplace_back("train_step " + name + ", " + mode,
                            [&x, &t, reset, pipe = pipes.back(), run = run]() mutable {
                              reset();
                              run(pipe, x, t);
                            });
    }
  }
  // The same layers, a copy whose first stage stays on the CPU: the input crosses to the CPU
  // and the activations back to the GPU, gradients the other way.
  torch::nn::Sequential model_cpu{nullptr};
  if (cpu_stage) {
    model_cpu = mlp(spec, torch::kCPU);
    std::vector<torch::Device> mixed(kStages, gpu.device);
    mixed[0] = torch::Device(torch::kCPU);
    auto pipe = sw::Pipe(model_cpu, balance,
                         sw::PipeOptions().chunks(spec.chunks).checkpoint("never").devices(mixed));
    variants.emplace_back(kCpuStage, [&x, &t, params = model_cpu->parameters(), pipe]() mutable {
      reset_grads(params);
      pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
    });
  }

  bench::Rounds r(opt.rounds, spec.calls, /*warmup=*/2);
  for (const auto& [name, fn] : variants) r.add(name, gpu.synced(fn));
  r.run();
  std::printf("%s: %s\n", label, spec.title.c_str());
  r.print();
  ModelResult out;
  out.overhead_vs_loop = r.wall_ratio(kHeadline, kLoop);
  bench::print_figure("whole batch / micro-batch loop, wall time", r.wall_ratio(kWhole, kLoop),
                      "x");
  for (const auto& [name, fn] : variants) {
    if (name != kWhole && name != kLoop) {
      bench::print_figure(name + " / micro-batch loop", r.wall_ratio(name, kLoop), "x");
    }
  }
  if (cpu_stage) {
    bench::print_figure("stage 0 on the CPU / all stages on the GPU (1F1B, never)",
                        r.wall_ratio(kCpuStage, kHeadline), "x");
  }

  // Where a step's peak comes from: what is alive before it, and one micro-batch's activations.
  long long param_bytes = 0;
  for (const auto& p : params) param_bytes += static_cast<long long>(p.nbytes());
  const long long data_bytes = static_cast<long long>(x.nbytes() + t.nbytes());
  reset();
  gpu.sync();
  long long micro_batch_bytes = 0;
  {
    const long long before = gpu.allocated();
    const auto held = model->forward(x.chunk(spec.chunks)[0]);  // keeps the graph alive
    gpu.sync();
    micro_batch_bytes = gpu.allocated() - before;
    (void)held;
  }
  std::printf(
      "%s memory: CUDA caching allocator, bytes allocated to tensors, one step after the "
      "gradients are reset to none%s\n",
      label, cpu_stage ? " (GPU only: the CPU stage's memory is not counted)" : "");
  std::printf(
      "  parameters %.1f MiB, their gradients %.1f MiB, input and target %.1f MiB; one "
      "micro-batch's forward with its graph held %.1f MiB (x %lld micro-batches = %.1f MiB)\n",
      mib(param_bytes), mib(param_bytes), mib(data_bytes), mib(micro_batch_bytes),
      static_cast<long long>(spec.chunks), mib(micro_batch_bytes * spec.chunks));
  std::printf("  %-46s %10s %10s %10s %10s\n", "variant", "base_MiB", "peak_MiB", "step_MiB",
              "peak/loop");
  std::vector<Peak> peaks;
  Peak loop_peak, never_peak, always_peak;
  for (const auto& [name, fn] : variants) {
    const auto& prepare = name == kCpuStage
                              ? std::function<void()>([&] { reset_grads(model_cpu->parameters()); })
                              : std::function<void()>(reset);
    peaks.push_back(measure_peak(gpu, prepare, fn));
    if (name == kLoop) loop_peak = peaks.back();
    if (name == kHeadline) never_peak = peaks.back();
    if (name == kAlways) always_peak = peaks.back();
  }
  for (std::size_t i = 0; i < variants.size(); ++i) {
    const Peak& p = peaks[i];
    std::printf("  %-46s %10.1f %10.1f %10.1f %10.3f\n", variants[i].first.c_str(), mib(p.base),
                mib(p.peak), mib(p.peak - p.base),
                static_cast<double>(p.peak) / static_cast<double>(loop_peak.peak));
  }
  out.always_peak_ratio =
      static_cast<double>(always_peak.peak) / static_cast<double>(never_peak.peak);
  row("peak ratio, train_step 1F1B: always / never", out.always_peak_ratio, "");
  row("step ratio (peak - base), train_step 1F1B: always / never",
      static_cast<double>(always_peak.peak - always_peak.base) /
          static_cast<double>(never_peak.peak - never_peak.base),
      "");
  reset();
  return out;
}

// ---- (c): the fused optimizer step -----------------------------------------------------------

enum class OptimKind { standard_pipe, fused_pipe, standard_whole, fused_whole };

constexpr const char* kStdPipe = "train_step 1F1B + Adam step";
constexpr const char* kFusedPipe = "train_step 1F1B, Adam fused";
constexpr const char* kStdWhole = "whole batch + Adam step";
constexpr const char* kFusedWhole = "whole batch, Adam fused";

// One model, its pipe (1F1B, checkpoint never) and data; the optimizers are made per use.
struct OptimSetup {
  torch::nn::Sequential model;
  std::vector<torch::Tensor> params;
  sw::Pipe<> pipe{nullptr};
  torch::Tensor x, t;
  torch::optim::AdamOptions adam_options{1e-4};

  OptimSetup(const ModelSpec& spec, const Gpu& gpu) : model(mlp(spec, gpu.device)) {
    params = model->parameters();
    x = torch::randn({spec.batch, spec.width}, gpu.device);
    t = torch::randn({spec.batch, spec.width}, gpu.device);
    pipe = sw::Pipe(model, sw::even_balance(2 * spec.layers, kStages),
                    sw::PipeOptions()
                        .chunks(spec.chunks)
                        .checkpoint("never")
                        .devices(std::vector<torch::Device>(kStages, gpu.device)));
  }

  std::shared_ptr<torch::optim::Adam> make_adam() {
    return std::make_shared<torch::optim::Adam>(params, adam_options);
  }
  // Detached until its step runs: its hooks would otherwise fire in the other variants' backward.
  std::shared_ptr<sw::optim::FusedStep> make_fused() {
    auto fused = std::make_shared<sw::optim::FusedStep>(params, adam_options);
    fused->detach();
    return fused;
  }

  // A step of `kind` with the given optimizers (the one the kind needs must be set). The
  // standard step is torch's: backward, step(), gradients set to none.
  std::function<void()> step(OptimKind kind, std::shared_ptr<torch::optim::Adam> adam,
                             std::shared_ptr<sw::optim::FusedStep> fused) {
    const auto reset = [ps = params] { reset_grads(ps); };
    switch (kind) {
      case OptimKind::standard_pipe:
        return [this, adam, reset] {
          pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
          adam->step();
          reset();
        };
      case OptimKind::fused_pipe:
        return [this, fused] {
          fused->attach();
          pipe->train_step(x, t, mse, *fused, sw::schedule::one_f_one_b{});
          fused->detach();
        };
      case OptimKind::standard_whole:
        return [this, adam, reset] {
          mse(model->forward(x), t).backward();
          adam->step();
          reset();
        };
      case OptimKind::fused_whole:
        return [this, fused] {
          fused->set_accumulation_steps(1);  // train_step sets it to the micro-batches
          fused->attach();
          mse(model->forward(x), t).backward();
          fused->finish_step();
          fused->detach();
        };
    }
    return [] {};
  }
};

struct OptimResult {
  double pipe_peak_ratio = std::nan(""), whole_peak_ratio = std::nan("");
};

OptimResult optimizer_section(const ModelSpec& spec, const Gpu& gpu, const Options& opt) {
  OptimSetup setup(spec, gpu);
  const std::pair<const char*, OptimKind> kinds[] = {{kStdPipe, OptimKind::standard_pipe},
                                                     {kFusedPipe, OptimKind::fused_pipe},
                                                     {kStdWhole, OptimKind::standard_whole},
                                                     {kFusedWhole, OptimKind::fused_whole}};
  const auto is_fused = [](OptimKind k) {
    return k == OptimKind::fused_pipe || k == OptimKind::fused_whole;
  };
  std::printf("(c) optimizer: %s; Adam (lr 1e-4); train_step: 1F1B, checkpoint never\n",
              spec.title.c_str());
  {
    // Time: one Adam for both standard variants, one FusedStep for both fused ones.
    auto adam = setup.make_adam();
    auto fused = setup.make_fused();
    bench::Rounds r(opt.rounds, spec.calls, /*warmup=*/2);
    for (const auto& [name, kind] : kinds) {
      r.add(name, gpu.synced(setup.step(kind, is_fused(kind) ? nullptr : adam,
                                        is_fused(kind) ? fused : nullptr)));
    }
    r.run();
    r.print();
    bench::print_figure("fused / standard, train_step, wall time",
                        r.wall_ratio(kFusedPipe, kStdPipe), "x");
    bench::print_figure("fused / standard, whole batch, wall time",
                        r.wall_ratio(kFusedWhole, kStdWhole), "x");
  }
  // Memory: each variant with only its own optimizer alive, after two steps (Adam's state exists).
  std::printf("  %-46s %10s %10s %10s\n", "variant (memory)", "base_MiB", "peak_MiB", "step_MiB");
  Peak peaks[4];
  for (int k = 0; k < 4; ++k) {
    const OptimKind kind = kinds[k].second;
    auto fn = setup.step(kind, is_fused(kind) ? nullptr : setup.make_adam(),
                         is_fused(kind) ? setup.make_fused() : nullptr);
    fn();
    fn();
    peaks[k] = measure_peak(
        gpu, [&] { reset_grads(setup.params); }, fn);
    std::printf("  %-46s %10.1f %10.1f %10.1f\n", kinds[k].first, mib(peaks[k].base),
                mib(peaks[k].peak), mib(peaks[k].peak - peaks[k].base));
  }
  OptimResult out;
  out.pipe_peak_ratio = static_cast<double>(peaks[1].peak) / static_cast<double>(peaks[0].peak);
  out.whole_peak_ratio = static_cast<double>(peaks[3].peak) / static_cast<double>(peaks[2].peak);
  row("peak ratio fused / standard, train_step", out.pipe_peak_ratio, "");
  row("peak ratio fused / standard, whole batch", out.whole_peak_ratio, "");
  return out;
}

// ---- (d): ParallelBranches -------------------------------------------------------------------

constexpr const char* kSequential = "experts one after another";
constexpr const char* kParallel = "ParallelBranches";
constexpr const char* kStreamsOnly = "ParallelBranches, pool of 1 (streams only)";
constexpr const char* kForwardSequential = "forward only, one after another";
constexpr const char* kForwardParallel = "forward only, ParallelBranches";

struct ExpertSpec {
  int64_t experts, dim, hidden, rows;
};

struct Experts {
  std::vector<torch::nn::Sequential> list;
  sw::ParallelBranches branches;
  sw::ParallelBranches one_thread{
      sw::ParallelBranchesOptions().pool(std::make_shared<sw::ThreadPool>(1))};
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> grads_to_reset;

  Experts(const ExpertSpec& spec, const torch::Device& device) {
    torch::manual_seed(0);
    for (int64_t e = 0; e < spec.experts; ++e) {
      list.emplace_back(torch::nn::Linear(spec.dim, spec.hidden), torch::nn::GELU(),
                        torch::nn::Linear(spec.hidden, spec.dim));
      list.back()->to(device);
      branches->push_back(list.back());
      one_thread->push_back(list.back());
      inputs.push_back(torch::randn({spec.rows, spec.dim}, device).requires_grad_(true));
    }
    grads_to_reset = branches->parameters();
    for (const auto& x : inputs) grads_to_reset.push_back(x);
  }

  static torch::Tensor loss_of(const std::vector<torch::Tensor>& outs) {
    auto loss = outs[0].sum();
    for (std::size_t i = 1; i < outs.size(); ++i) loss = loss + outs[i].sum();
    return loss;
  }
  std::vector<torch::Tensor> sequential_forward() {
    std::vector<torch::Tensor> outs;
    for (std::size_t i = 0; i < list.size(); ++i) outs.push_back(list[i]->forward(inputs[i]));
    return outs;
  }
  void sequential_step() {
    reset_grads(grads_to_reset);
    loss_of(sequential_forward()).backward();
  }
  void parallel_step(sw::ParallelBranches& with) {
    reset_grads(grads_to_reset);
    loss_of(with->forward_each(inputs)).backward();
  }
};

// One expert size: the experts one after another against ParallelBranches (forward+backward),
// and the forward alone, to tell where the time goes. Returns the forward+backward speed-up.
bench::Summary branches_table(const std::string& label, const ExpertSpec& spec, int calls,
                              const Gpu& gpu, const Options& opt, Watchdog& watchdog) {
  Experts experts(spec, gpu.device);
  std::printf(
      "%s: %lld experts [Linear(%lld,%lld), GELU, Linear(%lld,%lld)], %lld rows each; "
      "ParallelBranches on the default pool of %zu threads\n",
      label.c_str(), static_cast<long long>(spec.experts), static_cast<long long>(spec.dim),
      static_cast<long long>(spec.hidden), static_cast<long long>(spec.hidden),
      static_cast<long long>(spec.dim), static_cast<long long>(spec.rows),
      sw::default_thread_pool()->size());
  std::fflush(stdout);
  // A backward that waits on other threads' CUDA backward can deadlock (the device has one
  // autograd thread): one step first, under a short limit.
  watchdog.phase(label + ": the first ParallelBranches step on CUDA", std::chrono::seconds(60));
  gpu.synced([&] { experts.parallel_step(experts.branches); })();
  watchdog.phase(label + ": rounds", std::chrono::seconds(300));
  bench::Rounds r(opt.rounds, opt.quick ? 1 : calls, /*warmup=*/2);
  r.add(kSequential, gpu.synced([&] { experts.sequential_step(); }));
  r.add(kParallel, gpu.synced([&] { experts.parallel_step(experts.branches); }));
  r.add(kStreamsOnly, gpu.synced([&] { experts.parallel_step(experts.one_thread); }));
  r.add(kForwardSequential, gpu.synced([&] { (void)experts.sequential_forward(); }));
  r.add(kForwardParallel,
        gpu.synced([&] { (void)experts.branches->forward_each(experts.inputs); }));
  r.run();
  r.print();
  const auto speedup = r.wall_ratio(kSequential, kParallel);
  bench::print_figure("speed-up, one after another / ParallelBranches", speedup, "x");
  bench::print_figure("speed-up, one after another / streams only",
                      r.wall_ratio(kSequential, kStreamsOnly), "x");
  bench::print_figure("speed-up of the forward alone",
                      r.wall_ratio(kForwardSequential, kForwardParallel), "x");
  std::fflush(stdout);
  return speedup;
}

// The headline experts are small ones, as the issue that asked for this figure defined them; then
// experts 16 times larger with as few rows, whose products keep the GPU busy one at a time.
bench::Summary branches_section(bool quick, const Gpu& gpu, const Options& opt,
                                Watchdog& watchdog) {
  const ExpertSpec small{8, quick ? 32 : 512, quick ? 64 : 1024, quick ? 16 : 128};
  const ExpertSpec larger{8, quick ? 64 : 2048, quick ? 128 : 8192, quick ? 32 : 128};
  const auto speedup = branches_table("(d) branches", small, 10, gpu, opt, watchdog);
  branches_table("(d2) branches, larger experts", larger, 10, gpu, opt, watchdog);
  return speedup;
}

// ---- (e): activation offload -----------------------------------------------------------------

struct OffloadResult {
  bench::Summary time_ratio;              // GPipe, always: with offload / without
  double peak_ratio = std::nan("");       // the same, peaks
  bench::Summary torchgpipe_time_ratio;   // GPipe, always, offload / torchgpipe-style forward
  double torchgpipe_peak_ratio = std::nan("");
};

// Milliseconds of `fn` on the GPU, the median of 5 calls after one warm-up.
double gpu_ms(const Gpu& gpu, const std::function<void()>& fn) {
  fn();
  gpu.sync();
  std::vector<double> ms;
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    gpu.sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                           start)
                     .count());
  }
  return bench::summarize(ms).median;
}

// An activation-dominated model: each stage's input (what a checkpointed cell keeps, its
// boundary), for every micro-batch in flight, outweighs the parameters and their gradients.
// Checkpoint always, so every cell keeps only its boundary; with offload, HostStore moves the
// boundaries of stages 1..3 to pinned host memory and back, placed by schedule::offload from the
// copy and forward times measured here. The torchgpipe-style row is pipe->forward(x) + backward
// (torchgpipe's semantics and its default, checkpoint except_last), whose peak matched
// torchgpipe's on an H200 within a few MiB; torchgpipe itself is not installable on the GPU
// machine (no network), so this row stands for it.
OffloadResult offload_section(const ModelSpec& spec, const Gpu& gpu, const Options& opt) {
  auto [model, params, x, t, reset, balance, devices] = section_model(spec, gpu);

  // The offload pass's costs, in units of one stage's forward on one micro-batch.
  const auto micro = x.chunk(spec.chunks)[0].contiguous();
  auto stage = mlp(ModelSpec{"", spec.width, spec.layers / kStages, 0, 0, 0}, gpu.device);
  const double forward_ms = gpu_ms(gpu, [&] {
    torch::NoGradGuard no_grad;
    (void)stage->forward(micro);
  });
  auto host = torch::empty_like(micro, torch::TensorOptions().device(torch::kCPU).pinned_memory(true));
  const double copy_ms = gpu_ms(gpu, [&] { host.copy_(micro, /*non_blocking=*/true); });
  sw::schedule::OffloadCosts costs;
  costs.costs.offload = copy_ms / forward_ms;
  costs.costs.reload = copy_ms / forward_ms;

  const auto always = sw::PipeOptions().chunks(spec.chunks).checkpoint("always").devices(devices);
  sw::runtime::HostStore store;
  std::vector<std::pair<std::string, std::function<void()>>> variants;
  std::vector<sw::Pipe<>> pipes;
  for (const auto& [name, run] : schedules()) {
    if (name == "ZB-H1") continue;
    for (bool off : {false, true}) {
      pipes.push_back(sw::Pipe(model, balance,
                               off ? sw::PipeOptions(always).offload(store, costs) : always));
      variants.emplace_back("train_step " + name + ", always" + (off ? ", offload" : ""),
                            [&x, &t, reset, pipe = pipes.back(), run = run]() mutable {
                              reset();
                              run(pipe, x, t);
                            });
    }
  }
  const char* torchgpipe = "pipe->forward + backward, except_last (torchgpipe)";
  pipes.push_back(sw::Pipe(
      model, balance, sw::PipeOptions().chunks(spec.chunks).checkpoint("except_last").devices(devices)));
  variants.emplace_back(torchgpipe, [&x, &t, reset, pipe = pipes.back()]() mutable {
    reset();
    mse(pipe->forward(x), t).backward();
  });

  bench::Rounds r(opt.rounds, spec.calls, /*warmup=*/1);
  for (const auto& [name, fn] : variants) r.add(name, gpu.synced(fn));
  r.run();
  std::printf("(e) offload: %s; checkpoint always; HostStore (pinned host memory)\n",
              spec.title.c_str());
  std::printf("  measured: one stage's forward on a micro-batch %.3f ms, its boundary's copy to "
              "the host %.3f ms (%.1f MiB): offload and reload cost %.3f forwards\n",
              forward_ms, copy_ms, mib(static_cast<long long>(micro.nbytes())),
              costs.costs.offload);
  r.print();
  OffloadResult out;
  for (const char* s : {"GPipe", "1F1B"}) {
    const std::string base = std::string("train_step ") + s + ", always";
    const auto ratio = r.wall_ratio(base + ", offload", base);
    bench::print_figure(std::string(s) + ": time with offload / without", ratio, "x");
    if (std::string(s) == "GPipe") out.time_ratio = ratio;
  }
  out.torchgpipe_time_ratio = r.wall_ratio("train_step GPipe, always, offload", torchgpipe);
  bench::print_figure("GPipe with offload / torchgpipe-style", out.torchgpipe_time_ratio, "x");

  long long param_bytes = 0;
  for (const auto& p : params) param_bytes += static_cast<long long>(p.nbytes());
  std::printf(
      "(e) memory: parameters %.1f MiB and their gradients %.1f MiB; boundaries in flight under "
      "GPipe: %lld micro-batches x %d stages x %.1f MiB = %.1f MiB\n",
      mib(param_bytes), mib(param_bytes), static_cast<long long>(spec.chunks), kStages,
      mib(static_cast<long long>(micro.nbytes())),
      mib(static_cast<long long>(micro.nbytes()) * spec.chunks * kStages));
  std::printf("  %-52s %10s %10s %10s\n", "variant", "base_MiB", "peak_MiB", "step_MiB");
  std::vector<Peak> peaks;
  for (const auto& [name, fn] : variants) {
    peaks.push_back(measure_peak(gpu, reset, fn));
    std::printf("  %-52s %10.1f %10.1f %10.1f\n", name.c_str(), mib(peaks.back().base),
                mib(peaks.back().peak), mib(peaks.back().peak - peaks.back().base));
  }
  auto peak_of = [&](const std::string& name) {
    for (std::size_t i = 0; i < variants.size(); ++i) {
      if (variants[i].first == name) return static_cast<double>(peaks[i].peak);
    }
    return std::nan("");
  };
  for (const char* s : {"GPipe", "1F1B"}) {
    const std::string base = std::string("train_step ") + s + ", always";
    const double ratio = peak_of(base + ", offload") / peak_of(base);
    row(std::string(s) + ": peak with offload / without", ratio, "");
    if (std::string(s) == "GPipe") out.peak_ratio = ratio;
  }
  out.torchgpipe_peak_ratio = peak_of("train_step GPipe, always, offload") / peak_of(torchgpipe);
  row("GPipe with offload / torchgpipe-style, peak", out.torchgpipe_peak_ratio, "");
  std::printf("  pinned host buffers: %lld allocated, %.1f MiB (none after the first step)\n",
              static_cast<long long>(store.pinned_allocations()),
              mib(static_cast<long long>(store.pinned_bytes())));
  reset();
  return out;
}

// ---- (f): fp32, bf16, fp16 with a GradScaler ---------------------------------------------------

constexpr const char* kFp32 = "fp32";
constexpr const char* kBf16 = "bf16 autocast";
constexpr const char* kFp16 = "fp16 autocast + GradScaler";

// CUDA autocast to `dtype` for its lifetime (the stage workers inherit it); none for fp32.
struct CudaAutocast {
  explicit CudaAutocast(std::optional<at::ScalarType> dtype) : on(dtype.has_value()) {
    if (!on) return;
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_dtype(at::kCUDA, *dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
#else
    at::autocast::set_autocast_gpu_dtype(*dtype);
    at::autocast::set_enabled(true);
#endif
  }
  ~CudaAutocast() {
    if (!on) return;
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
    at::autocast::clear_cache();
  }
  CudaAutocast(const CudaAutocast&) = delete;
  CudaAutocast& operator=(const CudaAutocast&) = delete;
  bool on;
};

struct PrecisionResult {
  bench::Summary fp16_time_ratio;
  double fp16_peak_ratio = std::nan("");
};

PrecisionResult precision_section(const ModelSpec& spec, const Gpu& gpu, const Options& opt) {
  auto [model, params, x, t, reset, balance, devices] = section_model(spec, gpu);
  auto pipe = sw::Pipe(model, balance,
                       sw::PipeOptions().chunks(spec.chunks).checkpoint("never").devices(devices));
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-4));
  sw::amp::GradScaler scaler;
  const auto step = [&, reset](std::optional<at::ScalarType> dtype) {
    return [&, reset, dtype] {
      {
        CudaAutocast region(dtype);
        if (dtype == at::kHalf) {
          pipe->train_step(x, t, mse, scaler, sw::schedule::one_f_one_b{});
        } else {
          pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
        }
      }
      if (dtype == at::kHalf) {
        scaler.step(adam);
        scaler.update();
      } else {
        adam.step();
      }
      reset();
    };
  };
  const std::pair<const char*, std::optional<at::ScalarType>> kinds[] = {
      {kFp32, std::nullopt}, {kBf16, at::kBFloat16}, {kFp16, at::kHalf}};
  std::printf("(f) precision: %s; train_step 1F1B, checkpoint never, + Adam (lr 1e-4)\n",
              spec.title.c_str());
  bench::Rounds r(opt.rounds, spec.calls, /*warmup=*/2);
  for (const auto& [name, dtype] : kinds) r.add(name, gpu.synced(step(dtype)));
  r.run();
  r.print();
  PrecisionResult out;
  out.fp16_time_ratio = r.wall_ratio(kFp16, kFp32);
  bench::print_figure("bf16 / fp32, wall time", r.wall_ratio(kBf16, kFp32), "x");
  bench::print_figure("fp16 + GradScaler / fp32, wall time", out.fp16_time_ratio, "x");
  std::printf("  %-46s %10s %10s %10s\n", "variant (memory)", "base_MiB", "peak_MiB", "step_MiB");
  Peak peaks[3];
  for (int k = 0; k < 3; ++k) {
    auto fn = step(kinds[k].second);
    peaks[k] = measure_peak(gpu, reset, fn);
    std::printf("  %-46s %10.1f %10.1f %10.1f\n", kinds[k].first, mib(peaks[k].base),
                mib(peaks[k].peak), mib(peaks[k].peak - peaks[k].base));
  }
  out.fp16_peak_ratio = static_cast<double>(peaks[2].peak) / static_cast<double>(peaks[0].peak);
  row("peak ratio bf16 / fp32", static_cast<double>(peaks[1].peak) / peaks[0].peak, "");
  row("peak ratio fp16 + GradScaler / fp32", out.fp16_peak_ratio, "");
  std::printf("  GradScaler: scale %g after the steps (%s)\n", scaler.get_scale(),
              sw::detail::amp_kernels_on(gpu.device) ? "LibTorch's CUDA kernels"
                                                     : "the plain kernels");
  return out;
}

// ---- main --------------------------------------------------------------------------------------

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr,
               "pipe_cuda: %s\nusage: pipe_cuda [--rounds N] [--quick] [--device cuda:N] "
               "[--tf32] [--sections abcdef]\n",
               what.c_str());
  std::exit(2);
}

// ---- (g): the optimizer's state off the device ------------------------------------------------

struct StateOffloadResult {
  bench::Summary time_ratio;
  double bytes_per_param = std::nan("");
};

StateOffloadResult state_offload_section(const ModelSpec& spec, const Gpu& gpu, const Options& opt) {
  auto model = mlp(spec, gpu.device);
  const auto params = model->parameters();
  double count = 0;
  for (const auto& p : params) count += static_cast<double>(p.numel());
  const auto x = torch::randn({spec.batch, spec.width}, gpu.device);
  const auto t = torch::randn({spec.batch, spec.width}, gpu.device);
  // Two fused steps over the same parameters, each attached only for its own steps.
  auto fused = [&](bool offload) {
    auto f = std::make_shared<sw::optim::FusedStep>(params, torch::optim::AdamOptions(1e-4));
    if (offload) f->offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
    f->detach();
    return f;
  };
  auto step = [&](std::shared_ptr<sw::optim::FusedStep> f, torch::Tensor in, torch::Tensor target) {
    return [&model, f, in, target] {
      f->attach();
      mse(model->forward(in), target).backward();
      f->finish_step();  // the offloaded parameters take their values here
      f->detach();
    };
  };
  constexpr const char* kOnDevice = "whole batch, Adam fused, state on the GPU";
  constexpr const char* kOffloaded = "whole batch, Adam fused, state in a HostStore";
  std::printf("(g) optimizer state off the device: %s; Adam (lr 1e-4)\n", spec.title.c_str());
  StateOffloadResult out;
  {
    bench::Rounds r(opt.rounds, spec.calls, /*warmup=*/2);
    r.add(kOnDevice, gpu.synced(step(fused(false), x, t)));
    r.add(kOffloaded, gpu.synced(step(fused(true), x, t)));
    r.run();
    r.print();
    out.time_ratio = r.wall_ratio(kOffloaded, kOnDevice);
    bench::print_figure("state in a HostStore / on the GPU, wall time", out.time_ratio, "x");
  }
  const auto x8 = x.narrow(0, 0, 8), t8 = t.narrow(0, 0, 8);
  for (bool offload : {false, true}) {
    const auto fn = step(fused(offload), x8, t8);
    fn();
    fn();
    const Peak p = measure_peak(gpu, [&] { reset_grads(params); }, fn);
    const double per = static_cast<double>(p.peak) / count;
    std::printf("  %-46s %10.1f %10.1f  %.2f bytes per parameter\n",
                offload ? "8 rows, state in a HostStore" : "8 rows, state on the GPU",
                mib(p.base), mib(p.peak), per);
    if (offload) out.bytes_per_param = per;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options opt;
  bool rounds_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      const std::string eq = std::string(name) + "=";
      if (arg.rfind(eq, 0) == 0) return arg.substr(eq.size());
      if (i + 1 >= argc) usage_error(std::string(name) + " needs a value");
      return argv[++i];
    };
    if (arg == "--rounds" || arg.rfind("--rounds=", 0) == 0) {
      opt.rounds = std::atoi(value("--rounds").c_str());
      rounds_given = true;
      if (opt.rounds < 1) usage_error("--rounds takes a number >= 1");
    } else if (arg == "--device" || arg.rfind("--device=", 0) == 0) {
      opt.device = value("--device");
    } else if (arg == "--sections" || arg.rfind("--sections=", 0) == 0) {
      opt.sections = value("--sections");
      if (opt.sections.empty() || opt.sections.find_first_not_of("abcdefg") != std::string::npos) {
        usage_error("--sections takes letters of abcdefg, e.g. --sections e (got '" + opt.sections +
                    "')");
      }
    } else if (arg == "--quick") {
      opt.quick = true;
    } else if (arg == "--tf32") {
      opt.tf32 = true;
    } else if (arg == "-h" || arg == "--help") {
      std::printf(
          "pipe_cuda [--rounds N] [--quick] [--device cuda:N] [--tf32] [--sections abcdefg]\n"
          "  --rounds N       alternating rounds per table (default 7; 2 with --quick)\n"
          "  --quick          small sizes, for a smoke run (its figures mean nothing)\n"
          "  --device cuda:N  the GPU (default cuda:0); every stage goes there\n"
          "  --tf32           allow TF32 in fp32 matrix products (default: LibTorch's setting)\n"
          "  --sections abcdefg the sections to run (default all; the last line says nan for\n"
          "                   the figures of sections left out)\n"
          "Figures: docs/benchmarks.md, section \"pipe_cuda (GPU)\".\n");
      std::exit(0);
    } else {
      usage_error("unknown argument '" + arg + "'");
    }
  }
  if (opt.quick && !rounds_given) opt.rounds = 2;
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr,
                 "pipe_cuda: no CUDA device (torch::cuda::is_available() is false: no GPU, no "
                 "driver, or a CPU-only LibTorch). Run it on a GPU machine, built against a "
                 "CUDA LibTorch.\n");
    return 2;
  }
  std::optional<torch::Device> parsed;
  try {
    parsed.emplace(opt.device);
  } catch (const c10::Error&) {
    usage_error("--device '" + opt.device + "' is not a device; write cuda:N");
  }
  if (!parsed->is_cuda()) usage_error("--device '" + opt.device + "' is not a CUDA device");
  const c10::DeviceIndex index = parsed->has_index() ? parsed->index() : c10::DeviceIndex{0};
  const int count = static_cast<int>(torch::cuda::device_count());  // size_t or DeviceIndex
  if (index < 0 || index >= count) {
    std::fprintf(stderr, "pipe_cuda: --device %s, but this machine has %d CUDA device(s)\n",
                 opt.device.c_str(), count);
    return 2;
  }
  const Gpu gpu{torch::Device(torch::kCUDA, index), index};
  c10::cuda::CUDAGuard guard(index);
  if (opt.tf32) at::globalContext().setAllowTF32CuBLAS(true);

  bench::Conditions conditions("pipe_cuda");
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
  std::string name = prop->name;
  for (char& c : name) c = c == ' ' ? '_' : c;
  std::printf(
      "# gpu: device=%s name=%s capability=%d.%d memory_gib=%.1f multiprocessors=%d "
      "cuda_headers=%d.%d tf32_matmul=%d\n",
      gpu.device.str().c_str(), name.c_str(), prop->major, prop->minor,
      static_cast<double>(prop->totalGlobalMem) / (1024.0 * 1024.0 * 1024.0),
      prop->multiProcessorCount, CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10,
      at::globalContext().allowTF32CuBLAS() ? 1 : 0);
  std::printf(
      "pipe_cuda: %d alternating rounds; wall time with the GPU synchronized after each step, "
      "min / median / max%s\n",
      opt.rounds, opt.quick ? "; --quick: small sizes, the figures mean nothing" : "");
  std::fflush(stdout);

  // The headline figures so far, for the last line (also printed by the watchdog on a hang).
  std::atomic<double> overhead{std::nan("")}, ckpt_ratio{std::nan("")}, branches{std::nan("")};
  std::atomic<double> offload_peak{std::nan("")}, offload_time{std::nan("")};
  std::atomic<double> vs_torchgpipe_peak{std::nan("")}, vs_torchgpipe_time{std::nan("")};
  std::atomic<double> fp16_time{std::nan("")}, fp16_peak{std::nan("")};
  std::atomic<double> state_time{std::nan("")}, state_bytes{std::nan("")};
  const auto last_line = [&] {
    conditions.print_end();
    std::printf(
        "pipe_cuda overhead_vs_loop=%s ckpt_always_peak_ratio=%s branches_speedup=%s "
        "offload_peak_ratio=%s offload_time_ratio=%s offload_vs_torchgpipe_peak=%s "
        "offload_vs_torchgpipe_time=%s fp16_time_ratio=%s fp16_peak_ratio=%s "
        "gpu_offload_step_ratio=%s gpu_state_bytes_per_param=%s\n",
        fmt(overhead.load()).c_str(), fmt(ckpt_ratio.load()).c_str(), fmt(branches.load()).c_str(),
        fmt(offload_peak.load()).c_str(), fmt(offload_time.load()).c_str(),
        fmt(vs_torchgpipe_peak.load()).c_str(), fmt(vs_torchgpipe_time.load()).c_str(),
        fmt(fp16_time.load()).c_str(), fmt(fp16_peak.load()).c_str(),
        fmt(state_time.load()).c_str(), fmt(state_bytes.load()).c_str());
    std::fflush(stdout);
  };
  Watchdog watchdog([&](const std::string& what) {
    std::fprintf(stderr, "pipe_cuda: %s; stopping (exit code 3)\n", what.c_str());
    std::printf("# pipe_cuda stopped: %s\n", what.c_str());
    last_line();
  });

  const bool q = opt.quick;
  const ModelSpec large{q ? "16 x (Linear(512,512), GELU) in 4 stages, batch 256, chunks 8"
                          : "16 x (Linear(4096,4096), GELU) in 4 stages, batch 1024, chunks 8",
                        q ? 512 : 4096,
                        16,
                        q ? 256 : 1024,
                        8,
                        q ? 1 : 3};
  const ModelSpec small{q ? "16 x (Linear(64,64), GELU) in 4 stages, batch 256, chunks 8"
                          : "16 x (Linear(512,512), GELU) in 4 stages, batch 1024, chunks 8",
                        q ? 64 : 512,
                        16,
                        q ? 256 : 1024,
                        8,
                        q ? 1 : 5};
  const auto runs = [&](char section) { return opt.sections.find(section) != std::string::npos; };

  ModelResult a;
  if (runs('a')) {
    watchdog.phase("(a) large model", std::chrono::seconds(300));
    a = model_section("(a) large", large, gpu, opt, /*cpu_stage=*/false);
    overhead = a.overhead_vs_loop.median;
    ckpt_ratio = a.always_peak_ratio;
    std::fflush(stdout);
  }
  if (runs('b')) {
    watchdog.phase("(b) small model", std::chrono::seconds(300));
    model_section("(b) small", small, gpu, opt, /*cpu_stage=*/true);
    std::fflush(stdout);
  }
  if (runs('c')) {
    watchdog.phase("(c) optimizer", std::chrono::seconds(300));
    optimizer_section(large, gpu, opt);
    std::fflush(stdout);
  }
  if (runs('d')) branches = branches_section(q, gpu, opt, watchdog).median;
  if (runs('e')) {
    watchdog.phase("(e) offload", std::chrono::seconds(400));
    const ModelSpec heavy{q ? "16 x (Linear(256,256), GELU) in 4 stages, batch 4096, chunks 16"
                            : "16 x (Linear(2048,2048), GELU) in 4 stages, batch 65536, chunks 16",
                          q ? 256 : 2048,
                          16,
                          q ? 4096 : 65536,
                          16,
                          1};
    const auto e = offload_section(heavy, gpu, opt);
    offload_peak = e.peak_ratio;
    offload_time = e.time_ratio.median;
    vs_torchgpipe_peak = e.torchgpipe_peak_ratio;
    vs_torchgpipe_time = e.torchgpipe_time_ratio.median;
    std::fflush(stdout);
  }

  if (runs('f')) {
    watchdog.phase("(f) precision", std::chrono::seconds(300));
    const auto f = precision_section(large, gpu, opt);
    fp16_time = f.fp16_time_ratio.median;
    fp16_peak = f.fp16_peak_ratio;
    std::fflush(stdout);
  }

  if (runs('g')) {
    watchdog.phase("(g) optimizer state off the device", std::chrono::seconds(300));
    const auto g = state_offload_section(large, gpu, opt);
    state_time = g.time_ratio.median;
    state_bytes = g.bytes_per_param;
    std::fflush(stdout);
  }

  watchdog.phase("the summary", std::chrono::seconds(60));
  if (runs('a')) {
    std::printf("summary, medians of the per-round ratios [min, max]\n");
    bench::print_figure("overhead_vs_loop: train_step 1F1B, never / loop", a.overhead_vs_loop, "x");
  }
  last_line();
  return 0;
}
