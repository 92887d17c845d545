// gpt: examples/gpt's transformer trained three ways on the same 2 cores, one intra-op thread
// each: a plain LibTorch loop over the whole batch, the same loop over the pipe's micro-batches
// (one backward each, then the step), and the pipe (2 stages split by balance_by_time, 1F1B,
// checkpointing except_last on stage 0 and never on stage 1, whose backward follows each forward
// at once under 1F1B, so checkpointing it would save nothing; AdamW fused into backward). No
// clipping in any of them. A fourth row measures the machine: the micro-batch loop on two threads
// at once (two copies of the model, half the micro-batches each), the most any two-worker
// pipeline can gain here.
//   ./bazelw run -c opt //benchmarks:gpt [-- --rounds=5] [--batch=32] [--chunks=8] [--dim=64]
// Model: 4 blocks, dim 64, 4 heads, context 64, byte vocabulary; batch 32 rows (2048 tokens),
// chunks 8. Time: the variants alternate in rounds (benchmarks/common/rounds.hpp); tokens/s from
// the median step. Memory: the step's peak rise of live CPU tensor bytes (counting allocator)
// above what was alive before it (parameters and AdamW state, made by a warm-up step). Last line:
//   gpt tokens_per_s_ratio=<pipe / micro-batch loop> peak_ratio=<pipe / whole batch>
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/rounds.hpp"
#include "examples/gpt/data.hpp"
#include "examples/gpt/model.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

namespace sw = stagewise;
namespace bench = stagewise::bench;

namespace {

int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) {
      const long long v = std::atoll(argv[i] + prefix.size());
      if (v <= 0) {
        std::fprintf(stderr, "gpt benchmark: %s takes a positive whole number\n", prefix.c_str());
        std::exit(2);
      }
      return v;
    }
  }
  return fallback;
}

torch::nn::Sequential seeded_model(const gpt::Config& c) {
  torch::manual_seed(0);
  return gpt::make_model(c);
}

// The step's peak rise of live tensor bytes over what was alive before it.
long long peak_rise(const std::function<void()>& step) {
  auto& mem = bench::counting_allocator();
  const long long before = mem.current();
  mem.reset_peak();
  step();
  return mem.peak() - before;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rounds=", 0) && a.rfind("--batch=", 0) && a.rfind("--chunks=", 0) &&
        a.rfind("--dim=", 0)) {
      std::fprintf(stderr, "usage: gpt [--rounds=5] [--batch=32] [--chunks=8] [--dim=64]\n");
      return 2;
    }
  }
  bench::counting_allocator();  // before any tensor exists
  bench::Conditions conditions("gpt");
  at::set_num_threads(1);
  gpt::Config c;
  c.dim = flag(argc, argv, "dim", 64);
  const int64_t rounds = flag(argc, argv, "rounds", 5), batch = flag(argc, argv, "batch", 32),
                chunks = flag(argc, argv, "chunks", 8);
  const auto corpus = gpt::load_corpus();
  auto [x, y] = gpt::train_batch(corpus, 0, batch, c.context);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);

  auto whole_model = seeded_model(c);
  torch::optim::AdamW whole_opt(whole_model->parameters(), adamw);
  auto whole = [&] {
    gpt::lm_loss(whole_model->forward(x), y).backward();
    whole_opt.step();
    for (auto& p : whole_model->parameters()) p.mutable_grad().reset();
  };
  auto loop_model = seeded_model(c);
  torch::optim::AdamW loop_opt(loop_model->parameters(), adamw);
  auto loop = [&] {
    auto xs = x.chunk(chunks);
    auto ys = y.chunk(chunks);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      (gpt::lm_loss(loop_model->forward(xs[i]), ys[i]) * (double(xs[i].size(0)) / double(batch)))
          .backward();
    }
    loop_opt.step();
    for (auto& p : loop_model->parameters()) p.mutable_grad().reset();
  };
  auto pipe_model = seeded_model(c);
  const auto b = sw::balance_by_time(2, pipe_model, x.chunk(chunks)[0]);
  auto pipe = sw::Pipe(pipe_model, b,
                       sw::PipeOptions().chunks(chunks).checkpoint(
                           {sw::Checkpoint::except_last, sw::Checkpoint::never}));
  sw::optim::FusedStep fused(pipe->parameters(), adamw);
  auto piped = [&] { pipe->train_step(x, y, gpt::lm_loss, fused, sw::schedule::one_f_one_b{}); };

  // Two loops side by side, on half the micro-batches each: the machine's two-thread ceiling.
  auto half_model = seeded_model(c);
  auto other_model = seeded_model(c);
  auto half_loop = [&](torch::nn::Sequential& m, int64_t from) {
    at::set_num_threads(1);
    auto xs = x.chunk(chunks);
    auto ys = y.chunk(chunks);
    for (std::size_t i = static_cast<std::size_t>(from); i < xs.size(); i += 2) {
      (gpt::lm_loss(m->forward(xs[i]), ys[i]) * (double(xs[i].size(0)) / double(batch)))
          .backward();
    }
    for (auto& p : m->parameters()) p.mutable_grad().reset();
  };
  auto two_loops = [&] {
    std::thread other([&] { half_loop(other_model, 1); });
    half_loop(half_model, 0);
    other.join();
  };

  std::printf("model: %lld blocks, dim %lld, %lld heads, context %lld; batch %lld rows (%lld "
              "tokens), chunks %lld; pipe split %lld/%lld layers\n",
              (long long)c.layers, (long long)c.dim, (long long)c.heads, (long long)c.context,
              (long long)batch, (long long)(batch * c.context), (long long)chunks,
              (long long)b[0], (long long)b[1]);
  whole(), loop(), piped();  // warm-up: optimizer state exists before the peaks are taken
  const long long peak_whole = peak_rise(whole), peak_loop = peak_rise(loop),
                  peak_pipe = peak_rise(piped);
  bench::Rounds r(static_cast<int>(rounds), 1, 0);
  r.add("whole batch", whole);
  r.add("micro-batch loop", loop);
  r.add("pipe", piped);
  r.add("two loops side by side", two_loops);
  r.run();
  r.print();
  const double tokens = double(batch * c.context);
  auto tps = [&](const char* v) { return tokens / (r.wall(v).median / 1e6); };
  std::printf("%-18s %10s %12s\n", "variant", "tokens/s", "peak MiB");
  std::printf("%-18s %10.0f %12.2f\n", "whole batch", tps("whole batch"), peak_whole / 1048576.0);
  std::printf("%-18s %10.0f %12.2f\n", "micro-batch loop", tps("micro-batch loop"),
              peak_loop / 1048576.0);
  std::printf("%-18s %10.0f %12.2f\n", "pipe", tps("pipe"), peak_pipe / 1048576.0);
  bench::print_figure("pipe speed-up vs micro-batch loop", r.wall_ratio("micro-batch loop", "pipe"), "x");
  bench::print_figure("pipe speed-up vs whole batch", r.wall_ratio("whole batch", "pipe"), "x");
  bench::print_figure("two threads' speed-up vs micro-batch loop (the ceiling)",
                      r.wall_ratio("micro-batch loop", "two loops side by side"), "x");
  conditions.print_end();
  std::printf("gpt tokens_per_s_ratio=%.3f peak_ratio=%.3f\n",
              r.wall_ratio("micro-batch loop", "pipe").median,
              double(peak_pipe) / double(peak_whole));
  return 0;
}
