// distributed_cpu: stagewise's distributed pipe (2 ranks over Gloo, one intra-op thread each)
// against the same micro-batched model run sequentially in one process, against the in-process
// pipe, and against torch.distributed.pipelining's GPipe (benchmarks/anchors/torch_pipelining.py,
// nan where PyTorch < 2.4). Model: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU;
// batch 128, chunks 8; one step is forward and backward of the batch. Variants alternate in
// rounds; each prints min / median / max of its per-round medians.
//   ./bazelw run -c opt //benchmarks:distributed_cpu
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/Version.h>

#include "benchmarks/common/timing.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
using sw::bench::median_us;

namespace {

constexpr int kRounds = 7;
constexpr int kSteps = 10;  // timed steps per variant and round (median taken)

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

torch::nn::Sequential model() {
  torch::manual_seed(0);
  auto stage = [] {
    return torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                 torch::nn::Linear(512, 512), torch::nn::ReLU());
  };
  torch::nn::Sequential s;
  for (int k = 0; k < 2; ++k) {
    for (const auto& layer : stage()->children()) s->push_back(layer);
  }
  return s;
}

std::pair<torch::Tensor, torch::Tensor> batch() {
  torch::manual_seed(1);
  return {torch::randn({128, 512}), torch::randn({128, 512})};
}

// One rank of the distributed pipe: runs a variant when the parent asks ('g' gpipe, 'o' 1F1B,
// 'q' quit) and, on rank 0, answers with the median step time in microseconds.
[[noreturn]] void rank_main(int rank, int port, int commands, int answers) {
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  try {
    at::set_num_threads(1);
    sw::distributed::Pipe pipe(model(), sw::balance{4, 4},
                               sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::never));
    auto [x, t] = batch();
    auto params = pipe.parameters();
    for (char c; ::read(commands, &c, 1) == 1 && c != 'q';) {
      auto step = [&] {
        for (auto& p : params) p.mutable_grad() = torch::Tensor();
        if (c == 'g') {
          pipe.train_step(x, t, mse, sw::schedule::gpipe{});
        } else {
          pipe.train_step(x, t, mse, sw::schedule::one_f_one_b{});
        }
      };
      const double us = median_us(step, kSteps, 2);
      if (rank == 0) {
        [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(stdout);
  ::_exit(code);
}

// A port nobody listens on now: the kernel's choice for port 0 on loopback.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  TORCH_CHECK(fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
              "distributed_cpu: no free port on loopback");
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::map<std::string, double> run_anchor() {
  std::map<std::string, double> out;
  FILE* p = popen("/usr/bin/python3 benchmarks/anchors/torch_pipelining.py 2>/dev/null", "r");
  if (!p) return out;
  char line[512];
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

struct Spread {
  double min = NAN, median = NAN, max = NAN;
};
Spread spread(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

std::string blas() {
  const std::string config = at::show_config();
  const auto at = config.find("BLAS_INFO=");
  if (at == std::string::npos) return "unknown";
  return config.substr(at + 10, config.find_first_of(", \n", at + 10) - at - 10);
}

}  // namespace

int main() {
  // Fork the ranks first, while this process has one thread.
  const int port = free_port();
  int commands[2][2], answers[2];
  std::vector<pid_t> ranks;
  TORCH_CHECK(::pipe(answers) == 0, "pipe failed");
  for (int r = 0; r < 2; ++r) {
    TORCH_CHECK(::pipe(commands[r]) == 0, "pipe failed");
    const pid_t pid = ::fork();
    if (pid == 0) rank_main(r, port, commands[r][0], answers[1]);
    ranks.push_back(pid);
  }
  auto ask = [&](char c) {
    for (int r = 0; r < 2; ++r) {
      TORCH_CHECK(::write(commands[r][1], &c, 1) == 1, "a rank is gone");
    }
    double us = NAN;
    TORCH_CHECK(::read(answers[0], &us, sizeof us) == sizeof us, "rank 0 did not answer");
    return us;
  };

  at::set_num_threads(1);
  double load[3] = {0, 0, 0};
  std::ifstream("/proc/loadavg") >> load[0] >> load[1] >> load[2];
  std::printf(
      "# distributed_cpu: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU; batch "
      "128, chunks 8; forward+backward per step\n");
  std::printf(
      "# cores %u, load average %.2f %.2f %.2f, LibTorch %s, BLAS %s, %d rounds of %d "
      "steps\n",
      std::thread::hardware_concurrency(), load[0], load[1], load[2], TORCH_VERSION, blas().c_str(),
      kRounds, kSteps);

  auto seq = model();
  auto in_process = sw::Pipe(model(), sw::balance{4, 4},
                             sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::never));
  auto [x, t] = batch();
  std::map<std::string, std::vector<double>> times;
  for (int round = 0; round < kRounds; ++round) {
    times["sequential (micro-batched, 1 thread)"].push_back(median_us(
        [&] {
          seq->zero_grad();
          auto xs = x.chunk(8), ts = t.chunk(8);
          for (std::size_t i = 0; i < xs.size(); ++i) {
            (mse(seq->forward(xs[i]), ts[i]) * (double(xs[i].size(0)) / double(x.size(0))))
                .backward();
          }
        },
        kSteps, 2));
    times["in-process pipe, gpipe"].push_back(median_us(
        [&] {
          in_process->zero_grad();
          in_process->train_step(x, t, mse, sw::schedule::gpipe{});
        },
        kSteps, 2));
    times["distributed, gpipe"].push_back(ask('g'));
    times["distributed, 1F1B"].push_back(ask('o'));
  }
  for (int r = 0; r < 2; ++r) {
    const char q = 'q';
    [[maybe_unused]] auto n = ::write(commands[r][1], &q, 1);
  }
  int failed = 0;
  for (auto pid : ranks) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const auto anchor = run_anchor();
  const double torch_us =
      anchor.count("torch_pipelining_us") ? anchor.at("torch_pipelining_us") : NAN;

  std::printf("  %-40s %10s %10s %10s\n", "variant (us per step)", "min", "median", "max");
  for (const auto& [name, v] : times) {
    const auto s = spread(v);
    std::printf("  %-40s %10.0f %10.0f %10.0f\n", name.c_str(), s.min, s.median, s.max);
  }
  std::printf("  %-40s %10.0f %10.0f %10.0f\n", "torch.distributed.pipelining GPipe",
              anchor.count("torch_pipelining_min_us") ? anchor.at("torch_pipelining_min_us") : NAN,
              torch_us,
              anchor.count("torch_pipelining_max_us") ? anchor.at("torch_pipelining_max_us") : NAN);
  const double sequential = spread(times["sequential (micro-batched, 1 thread)"]).median;
  const double gpipe = spread(times["distributed, gpipe"]).median;
  const double ofob = spread(times["distributed, 1F1B"]).median;
  const double inproc = spread(times["in-process pipe, gpipe"]).median;
  std::printf(
      "distributed_cpu speedup_vs_sequential=%.2f one_f_one_b_speedup=%.2f "
      "ratio_vs_in_process=%.2f speedup_vs_torch_pipelining=%.2f\n",
      sequential / gpipe, sequential / ofob, inproc / gpipe, torch_us / gpipe);
  return failed ? 1 : 0;
}
