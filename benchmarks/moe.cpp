// moe: a mixture-of-experts block trained the standard way (experts one after another, Adam,
// 2 intra-op threads) and the stagewise way (experts in parallel with ParallelBranches inside a
// pipeline stage of 4 checkpointed micro-batches, Adam fused into backward), on the same 2 cores.
//   ./bazelw run -c opt //benchmarks:moe [-- --rounds N] [--grid] [--tokens N] [--chunks N]
//       [--checkpoint never|always|except_last] [--pool N] [--expert-checkpoint]
// Model: LayerNorm, router, E = 4 experts of Linear(512, 2048), GELU, Linear(2048, 512), top-2,
// 4096 tokens per step, then a Linear(512, 512) head; MSE loss. Memory: every live CPU tensor
// byte at the step's peak (counting allocator), parameters and Adam state included. Time: the two
// variants alternate in rounds; min / median / max of the steps.
//
// BLAS: STAGEWISE_BLAS=openblas re-executes the program with OpenBLAS first in LD_LIBRARY_PATH
// (fetched once with apt-get download + dpkg -x into ~/.cache/stagewise/openblas; the system is
// not touched); STAGEWISE_BLAS=default uses the system's. Unset, the program runs both, the
// OpenBLAS run as a child process. The last line is
//   moe step_speedup=<standard / stagewise, OpenBLAS> peak_ratio=<stagewise / standard>
#include "benchmarks/common/memory.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
namespace bench = stagewise::bench;
using torch::autograd::AutogradContext;

namespace {

constexpr int64_t kDim = 512, kHidden = 2048, kExperts = 4, kTopK = 2;
int64_t step_tokens = 4096;  // tokens per step: --tokens N

// Adds `aux` to the training loss without changing `y` (backward gives `aux` the gradient 1).
struct AddAuxLoss : torch::autograd::Function<AddAuxLoss> {
  static torch::Tensor forward(AutogradContext*, torch::Tensor y, torch::Tensor) { return y; }
  static torch::autograd::variable_list backward(AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0], torch::ones({}, g[0].options())};
  }
};

// x + MoE(LayerNorm(x)), top-k routing, Switch load-balancing loss (as in examples/moe.cpp).
struct MoEBlockImpl : torch::nn::Module {
  MoEBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    router = register_module("router", torch::nn::Linear(kDim, kExperts));
    experts = register_module("experts", sw::ParallelBranches());
    for (int64_t e = 0; e < kExperts; ++e) {
      list.push_back(torch::nn::Sequential(torch::nn::Linear(kDim, kHidden), torch::nn::GELU(),
                                           torch::nn::Linear(kHidden, kDim)));
      auto expert = list.back();
      experts->push_back(std::to_string(e), expert);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto h = norm->forward(x);
    auto probs = torch::softmax(router->forward(h), -1);
    auto [gate, choice] = probs.topk(kTopK, -1);
    gate = gate / gate.sum(-1, true);
    std::vector<torch::Tensor> token, weight, inputs;
    for (int64_t e = 0; e < kExperts; ++e) {
      auto hit = (choice == e).nonzero();
      token.push_back(hit.select(1, 0));
      weight.push_back(gate.flatten().index_select(0, token.back() * kTopK + hit.select(1, 1)));
      inputs.push_back(h.index_select(0, token.back()));
    }
    tokens = torch::bincount(choice.flatten(), {}, kExperts);
    auto share = tokens.to(torch::kFloat) / choice.numel();
    auto aux = kExperts * (share * probs.mean(0)).sum();
    std::vector<torch::Tensor> outs;
    if (parallel) {
      std::vector<sw::TensorBranch> branches;
      for (auto& holder : list) {
        auto expert = holder.ptr();  // the holder is const inside a lambda; its module is not
        if (checkpoint_experts) {
          branches.push_back([expert](const torch::Tensor& t) {
            return sw::checkpoint([expert](const torch::Tensor& u) { return expert->forward(u); },
                                  t);
          });
        } else {
          branches.push_back([expert](const torch::Tensor& t) { return expert->forward(t); });
        }
      }
      outs = sw::parallel_branches(branches, inputs, pool);
    } else {
      for (int64_t e = 0; e < kExperts; ++e) {
        outs.push_back(inputs[e].size(0) ? list[e]->forward(inputs[e]) : inputs[e]);
      }
    }
    auto y = torch::zeros_like(h);
    for (int64_t e = 0; e < kExperts; ++e)
      y.index_add_(0, token[e], outs[e] * weight[e].unsqueeze(1));
    return AddAuxLoss::apply(x + y, 0.01 * aux);
  }

  bool parallel = false;
  bool checkpoint_experts = false;
  std::shared_ptr<sw::ThreadPool> pool = sw::default_thread_pool();
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear router{nullptr};
  sw::ParallelBranches experts{nullptr};
  std::vector<torch::nn::Sequential> list;
  torch::Tensor tokens;
};
TORCH_MODULE(MoEBlock);

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

// OpenBLAS runs its own threads, which at::set_num_threads does not reach: set them too (a no-op
// with a BLAS that has no such function, e.g. the reference BLAS, which is single-threaded).
void set_blas_threads(int n) {
  using set_fn = void (*)(int);
  static const auto fn = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (fn) fn(n);
}

// How the stagewise variant runs.
struct Config {
  // The default: 4 micro-batches, each checkpointed but the last (whose backward comes right
  // after its forward), experts not checkpointed inside (the stage's recompute covers them).
  int64_t chunks = 4;
  sw::Checkpoint mode = sw::Checkpoint::except_last;
  bool checkpoint_experts = false;
  bool fused = true;
  std::size_t pool = 2;  // threads running the experts (the caller included)

  std::string describe() const {
    std::ostringstream os;
    os << "chunks " << chunks << ", checkpoint "
       << (mode == sw::Checkpoint::never    ? "never"
           : mode == sw::Checkpoint::always ? "always"
                                            : "except_last")
       << ", experts checkpointed " << (checkpoint_experts ? "yes" : "no") << ", fused step "
       << (fused ? "yes" : "no") << ", expert threads " << pool;
    return os.str();
  }
};

// One variant: the model, its data and its step.
struct Variant {
  MoEBlock block;
  torch::nn::Linear head{nullptr};
  torch::Tensor x, y;
  std::unique_ptr<torch::optim::Adam> adam;
  std::unique_ptr<sw::optim::FusedStep> fused;
  sw::Pipe<MoEBlock, torch::nn::Linear> pipe{nullptr};
  bool stagewise;
  int intra_op_threads;

  Variant(bool stagewise, Config cfg) : stagewise(stagewise) {
    torch::manual_seed(0);
    block = MoEBlock();
    head = torch::nn::Linear(kDim, kDim);
    x = torch::randn({step_tokens, kDim});
    y = torch::randn({step_tokens, kDim});
    const auto options = torch::optim::AdamOptions(1e-4);
    intra_op_threads = stagewise ? 1 : 2;
    if (stagewise) {
      block->parallel = true;
      block->checkpoint_experts = cfg.checkpoint_experts;
      block->pool = std::make_shared<sw::ThreadPool>(cfg.pool);
      pipe = sw::Pipe(sw::stages(block, head),
                      sw::PipeOptions().chunks(cfg.chunks).checkpoint(cfg.mode));
      if (cfg.fused) {
        fused = std::make_unique<sw::optim::FusedStep>(pipe->parameters(), options);
      } else {
        adam = std::make_unique<torch::optim::Adam>(pipe->parameters(), options);
      }
    } else {
      std::vector<torch::Tensor> params = block->parameters();
      for (auto& p : head->parameters()) params.push_back(p);
      adam = std::make_unique<torch::optim::Adam>(params, options);
    }
    step();  // Adam's state exists from here on: the measured steps are steady-state ones
  }

  void step() {
    at::set_num_threads(intra_op_threads);
    set_blas_threads(intra_op_threads);
    if (stagewise && fused) {
      pipe->train_step(x, y, mse, *fused);
    } else {
      if (stagewise) {
        pipe->train_step(x, y, mse);
      } else {
        mse(head->forward(block->forward(x)), y).backward();
      }
      adam->step();
      for (auto& group : adam->param_groups()) {
        for (auto& p : group.params()) p.mutable_grad().reset();  // zero_grad(set_to_none)
      }
    }
  }
};

double mib(long long bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

struct Memory {
  long long before = 0, peak = 0;
};

Memory measure_memory(bool stagewise, Config cfg) {
  auto& mem = bench::counting_allocator();
  Variant v(stagewise, cfg);
  Memory m;
  m.before = mem.current();
  mem.reset_peak();
  v.step();
  m.peak = mem.peak();
  return m;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// The BLAS library mapped into this process (what LibTorch's matrix products call).
std::string blas_in_use() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    for (const char* name : {"openblas", "libblas", "mkl", "blis"}) {
      if (line.find(name) != std::string::npos) return line.substr(line.find('/'));
    }
  }
  return "none found in /proc/self/maps";
}

struct Stats {
  double min = 0, median = 0, max = 0;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// STAGEWISE_BLAS=openblas: OpenBLAS's directory, fetched on first use without touching the system.
std::string openblas_dir() {
  const char* home = std::getenv("HOME");
  const std::string cache = std::string(home ? home : "/tmp") + "/.cache/stagewise/openblas";
  const std::string lib = cache + "/usr/lib/x86_64-linux-gnu/openblas-pthread";
  if (access((lib + "/libblas.so.3").c_str(), R_OK) != 0) {
    const std::string cmd = "mkdir -p " + cache + " && cd " + cache +
                            " && apt-get download libopenblas0-pthread >/dev/null && dpkg -x "
                            "libopenblas0-pthread_*.deb " +
                            cache;
    std::fprintf(stderr, "fetching OpenBLAS: %s\n", cmd.c_str());
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr,
                   "moe: could not fetch OpenBLAS into %s (apt-get download "
                   "libopenblas0-pthread failed); run with STAGEWISE_BLAS=default.\n",
                   cache.c_str());
      std::exit(2);
    }
  }
  return lib;
}

// Re-executes this program with OpenBLAS first in LD_LIBRARY_PATH, unless already done.
void use_openblas(char** argv) {
  const std::string lib = openblas_dir();
  const char* current = std::getenv("LD_LIBRARY_PATH");
  if (current && std::string(current).find(lib) != std::string::npos) return;
  const std::string path = current && *current ? lib + ":" + current : lib;
  setenv("LD_LIBRARY_PATH", path.c_str(), 1);
  // Idle OpenBLAS threads sleep at once instead of spinning for about 0.1 s after the standard
  // variant's 2-thread calls, which would take a core from the variant that runs next.
  setenv("OPENBLAS_THREAD_TIMEOUT", "4", 0);
  execv("/proc/self/exe", argv);
  std::perror("moe: execv");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  bool grid = false;
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = std::stoi(argv[++i]);
    if (std::strcmp(argv[i], "--grid") == 0) grid = true;
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) step_tokens = std::stol(argv[++i]);
    if (std::strcmp(argv[i], "--chunks") == 0 && i + 1 < argc) cfg.chunks = std::stoi(argv[++i]);
    if (std::strcmp(argv[i], "--pool") == 0 && i + 1 < argc) cfg.pool = std::stoul(argv[++i]);
    if (std::strcmp(argv[i], "--no-expert-checkpoint") == 0) cfg.checkpoint_experts = false;
    if (std::strcmp(argv[i], "--expert-checkpoint") == 0) cfg.checkpoint_experts = true;
    if (std::strcmp(argv[i], "--checkpoint") == 0 && i + 1 < argc) {
      const std::string m = argv[++i];
      cfg.mode = m == "always"        ? sw::Checkpoint::always
                 : m == "except_last" ? sw::Checkpoint::except_last
                                      : sw::Checkpoint::never;
    }
  }
  const char* blas_env = std::getenv("STAGEWISE_BLAS");
  const std::string blas = blas_env ? blas_env : "";
  if (blas == "openblas") use_openblas(argv);
  bench::counting_allocator();  // before any tensor exists

  std::printf("moe: %ld experts of Linear(%ld, %ld), GELU, Linear(%ld, %ld), top-%ld, %ld tokens\n",
              kExperts, kDim, kHidden, kHidden, kDim, kTopK, step_tokens);
  std::printf("cores %u, load average at start %s, LibTorch %s, BLAS %s\n",
              std::thread::hardware_concurrency(), load_average().c_str(), TORCH_VERSION,
              blas_in_use().c_str());
  std::printf("stagewise variant: %s\n", cfg.describe().c_str());
  if (grid) {  // memory of other stagewise settings, for the docs
    std::printf("%-62s %10s %8s %9s\n", "stagewise settings", "before_MiB", "peak_MiB",
                "extra_MiB");
    const Memory s = measure_memory(false, cfg);
    std::printf("%-62s %10.1f %8.1f %9.1f\n", "standard", mib(s.before), mib(s.peak),
                mib(s.peak - s.before));
    std::vector<Config> grid_configs{{1, sw::Checkpoint::never, false, false, 2}};
    for (int64_t chunks : {1, 4}) {
      for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::always}) {
        for (bool per_expert : {false, true}) {
          for (std::size_t pool : {1, 2})
            grid_configs.push_back({chunks, mode, per_expert, true, pool});
        }
      }
    }
    for (const auto& c : grid_configs) {
      const Memory m = measure_memory(true, c);
      std::printf("%-62s %10.1f %8.1f %9.1f\n", c.describe().c_str(), mib(m.before), mib(m.peak),
                  mib(m.peak - m.before));
    }
    std::fflush(stdout);
  }

  const Memory mem_std = measure_memory(false, cfg);
  const Memory mem_sw = measure_memory(true, cfg);
  Variant standard(false, cfg), stagewise(true, cfg);
  std::vector<double> t_std, t_sw, ratios;
  for (int r = 0; r < rounds; ++r) {
    double round_ms[2];
    for (int v = 0; v < 2; ++v) {
      const auto t0 = std::chrono::steady_clock::now();
      (v == 0 ? standard : stagewise).step();
      round_ms[v] = ms_since(t0);
    }
    t_std.push_back(round_ms[0]);
    t_sw.push_back(round_ms[1]);
    ratios.push_back(round_ms[0] / round_ms[1]);
  }
  const Stats s = stats_of(t_std), w = stats_of(t_sw), q = stats_of(ratios);
  std::printf("%-10s %11s %9s %10s %8s %8s %8s\n", "variant", "before_MiB", "peak_MiB", "extra_MiB",
              "min_ms", "med_ms", "max_ms");
  std::printf("%-10s %11.1f %9.1f %10.1f %8.1f %8.1f %8.1f\n", "standard", mib(mem_std.before),
              mib(mem_std.peak), mib(mem_std.peak - mem_std.before), s.min, s.median, s.max);
  std::printf("%-10s %11.1f %9.1f %10.1f %8.1f %8.1f %8.1f\n", "stagewise", mib(mem_sw.before),
              mib(mem_sw.peak), mib(mem_sw.peak - mem_sw.before), w.min, w.median, w.max);
  const double peak_ratio = static_cast<double>(mem_sw.peak) / static_cast<double>(mem_std.peak);
  std::printf(
      "tokens per expert (last step): %s; standard/stagewise per round: min %.3f median %.3f "
      "max %.3f (%d rounds); load average at end %s\n",
      [&] {
        std::ostringstream os;
        for (int64_t e = 0; e < kExperts; ++e)
          os << (e ? " " : "") << stagewise.block->tokens[e].item<int64_t>();
        return os.str();
      }()
          .c_str(),
      q.min, q.median, q.max, rounds, load_average().c_str());
  std::printf("blas=%s speedup=%.3f peak_ratio=%.3f\n", blas.empty() ? "default" : blas.c_str(),
              q.median, peak_ratio);
  std::fflush(stdout);

  double speedup = q.median;
  if (blas.empty()) {  // the OpenBLAS run, in a child process
    std::string cmd = "STAGEWISE_BLAS=openblas /proc/" + std::to_string(getpid()) + "/exe";
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--grid") != 0) cmd += std::string(" ") + argv[i];
    }
    std::printf("\n-- the same with OpenBLAS --\n");
    std::fflush(stdout);
    FILE* child = popen(cmd.c_str(), "r");
    char line[4096];
    while (child && std::fgets(line, sizeof line, child)) {
      if (std::strncmp(line, "moe step_speedup=", 17) == 0) continue;
      std::fputs(line, stdout);
      double sp = 0, pr = 0;
      if (std::sscanf(line, "blas=openblas speedup=%lf peak_ratio=%lf", &sp, &pr) == 2) {
        speedup = sp;
      }
    }
    if (!child || pclose(child) != 0)
      std::printf("(the OpenBLAS run failed: speedup is BLAS default)\n");
  }
  std::printf("moe step_speedup=%.3f peak_ratio=%.3f\n", speedup, peak_ratio);
  return 0;
}
