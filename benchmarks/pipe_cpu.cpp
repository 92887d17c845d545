// pipe_cpu: stagewise's pipeline on CPU against the same model run sequentially and against
// PyTorch's own torch.distributed.pipeline.sync.Pipe (benchmarks/anchors/torch_pipe.py).
//   ./bazelw run -c opt //benchmarks:pipe_cpu
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/timing.hpp"

#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

namespace sw = stagewise;
using sw::bench::median_us;

namespace {

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); }

// Forward and backward over the micro-batches one after another, as the pipe splits them.
template <class Model>
void microbatch_loop(Model& model, const torch::Tensor& x, const torch::Tensor& t, int64_t chunks) {
  auto xs = x.chunk(chunks);
  auto ts = t.chunk(chunks);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    (mse(model(xs[i]), ts[i]) * (double(xs[i].size(0)) / double(x.size(0)))).backward();
  }
}

std::map<std::string, double> run_anchor() {
  std::map<std::string, double> out;
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) return out;
  FILE* p = popen("/usr/bin/python3 benchmarks/anchors/torch_pipe.py 2>/dev/null", "r");
  if (!p) return out;
  char line[256];
  while (std::fgets(line, sizeof line, p)) {
    std::string s(line);
    auto eq = s.find('=');
    if (eq == std::string::npos) continue;
    try {
      out[s.substr(0, eq)] = std::stod(s.substr(eq + 1));
    } catch (...) {
    }
  }
  pclose(p);
  return out;
}

void row(const std::string& what, double value, const std::string& unit) {
  std::printf("  %-52s %12.2f %s\n", what.c_str(), value, unit.c_str());
}

}  // namespace

int main() {
  at::set_num_threads(1);
  torch::manual_seed(0);
  auto& memory = sw::bench::counting_allocator();

  // (a) overhead: 4 stages of Linear(16,16), batch 32, chunks 32, no checkpointing.
  torch::nn::Sequential tiny;
  for (int i = 0; i < 4; ++i) tiny->push_back(torch::nn::Linear(16, 16));
  auto tiny_pipe = sw::Pipe(tiny, sw::balance{1, 1, 1, 1}, sw::PipeOptions().chunks(32).checkpoint("never"));
  auto xa = torch::randn({32, 16});
  auto ta = torch::randn({32, 16});
  auto tiny_fn = [&](const torch::Tensor& x) { return tiny->forward(x); };
  const double a_seq = median_us([&] { microbatch_loop(tiny_fn, xa, ta, 32); }, 50);
  const double a_pipe = median_us([&] { tiny_pipe->train_step(xa, ta, mse); }, 50);
  const double a_forward = median_us([&] { mse(tiny_pipe->forward(xa), ta).backward(); }, 50);
  const double overhead = (a_pipe - a_seq) / (32 * 4);

  // (b) speed: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU; batch 128, chunks 8.
  auto stage = [] {
    return torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                 torch::nn::Linear(512, 512), torch::nn::ReLU());
  };
  auto s0 = stage();
  auto s1 = stage();
  auto whole = [&](const torch::Tensor& x) { return s1->forward(s0->forward(x)); };
  auto big_pipe = sw::Pipe(sw::stages(s0, s1), sw::PipeOptions().chunks(8).checkpoint("never"));
  auto xb = torch::randn({128, 512});
  auto tb = torch::randn({128, 512});
  auto sequential_step = [&] { mse(whole(xb), tb).backward(); };
  const double b_seq1 = median_us(sequential_step);
  at::set_num_threads(2);
  const double b_seq2 = median_us(sequential_step);
  at::set_num_threads(1);
  const double b_pipe = median_us([&] { big_pipe->train_step(xb, tb, mse); });
  const double b_loop = median_us([&] { microbatch_loop(whole, xb, tb, 8); });

  // (c) memory: 4 stages of 4 x (Linear(512,512), ReLU), batch 256, chunks 8.
  torch::nn::Sequential deep;
  for (int i = 0; i < 16; ++i) {
    deep->push_back(torch::nn::Linear(512, 512));
    deep->push_back(torch::nn::ReLU());
  }
  auto xc = torch::randn({256, 512});
  auto tc = torch::randn({256, 512});
  std::map<std::string, double> peak;
  for (const char* mode : {"never", "except_last", "always"}) {
    auto pipe = sw::Pipe(deep, sw::even_balance(32, 4), sw::PipeOptions().chunks(8).checkpoint(mode));
    pipe->train_step(xc, tc, mse);  // warm-up: gradients exist from here on
    memory.reset_peak();
    const long long base = memory.current();
    pipe->train_step(xc, tc, mse);
    peak[mode] = double(memory.peak() - base);
  }

  const auto anchor = run_anchor();
  const bool have_anchor = anchor.count("b_pipe_us") > 0;

  std::printf("pipe_cpu (intra-op threads 1 per worker, medians)\n");
  std::printf("(a) overhead: 4 x Linear(16,16), batch 32, chunks 32, checkpoint never\n");
  row("sequential micro-batch loop, fwd+bwd", a_seq, "us");
  row("stagewise train_step, fwd+bwd", a_pipe, "us");
  row("stagewise forward() + backward (torchgpipe style)", a_forward, "us");
  row("stagewise overhead per cell", overhead, "us");
  if (have_anchor) {
    row("torch Pipe fwd+bwd", anchor.at("a_pipe_us"), "us");
    row("torch Pipe overhead per cell", anchor.at("a_overhead_us_per_cell"), "us");
  }
  std::printf("(b) speed: 2 x [Linear(512,512), ReLU] x 2, batch 128, chunks 8, checkpoint never\n");
  row("sequential, 1 intra-op thread", b_seq1, "us");
  row("sequential, 2 intra-op threads", b_seq2, "us");
  row("sequential micro-batch loop, 1 thread", b_loop, "us");
  row("stagewise train_step, 2 workers x 1 thread", b_pipe, "us");
  if (have_anchor) row("torch Pipe, 1 thread", anchor.at("b_pipe_us"), "us");
  row("speed-up vs sequential (1 thread)", b_seq1 / b_pipe, "x");
  row("speed-up vs sequential (2 threads)", b_seq2 / b_pipe, "x");
  if (have_anchor) row("speed-up vs torch Pipe", anchor.at("b_pipe_us") / b_pipe, "x");
  std::printf("(c) memory: 16 x (Linear(512,512), ReLU) in 4 stages, batch 256, chunks 8\n");
  for (const char* mode : {"never", "except_last", "always"}) {
    row(std::string("peak tensor memory, checkpoint ") + mode, peak[mode] / (1 << 20), "MiB");
  }
  row("ratio except_last / never", peak["except_last"] / peak["never"], "");
  row("ratio always / never", peak["always"] / peak["never"], "");

  std::ostringstream last;
  last << "pipe_cpu overhead_us_per_cell=" << overhead << " speedup_vs_sequential=" << b_seq1 / b_pipe
       << " speedup_vs_sequential_2threads=" << b_seq2 / b_pipe << " speedup_vs_torch_pipe=";
  if (have_anchor) {
    last << anchor.at("b_pipe_us") / b_pipe;
  } else {
    last << "nan";
  }
  std::cout << last.str() << std::endl;
  return 0;
}
