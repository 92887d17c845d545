#pragma once

// distributed_cpu's sharded-state section (benchmarks/distributed_cpu.cpp): jobs of forked ranks
// that train with optimizer state sharded over data-parallel replicas (ZeRO) and without, and
// answer the parent's commands: a 2-stage x 2-replica pipe (4 ranks) and a 1 x 2 DataParallel (2
// ranks), Adam, one intra-op thread per rank. Per variant: the step time, and the bytes of tensor
// memory a rank's process holds at the peak of its step per parameter of its stage (MemoryMeter:
// one rank is one device), on a step of 1-row micro-batches so that what is not model state
// (activations, the transport's posted receives) stays under 1% of the parameters' bytes.

#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/timing.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace stagewise::bench::zero {

constexpr int kSteps = 4;          // timed steps per variant and round (median taken)
constexpr int kLayers = 8;         // [Linear(512,512), ReLU] per stage in the timed steps
constexpr int kMemoryLayers = 32;  // and in the measured ones (one layer: 1/32 of the stage)
constexpr int kRows = 128;         // the global batch
constexpr int kChunks = 8;

/// The variants, in the order the tables print them.
enum Variant { kPlain, kFused, kSharded, kShardedFused, kZero2Fused, kVariants };
inline const char* const kNames[kVariants] = {
    "unsharded, Adam", "unsharded, fused Adam", "sharded state (ZeRO-1), Adam",
    "sharded state (ZeRO-1), fused Adam", "sharded state and gradients (ZeRO-2), fused Adam"};
/// The DataParallel job has no ZeRO-2 variant of its own: one backward per step is both.
constexpr int kDataParallelVariants = 4;

/// 2 x `layers` [Linear(512,512), ReLU] (balance {2 layers, 2 layers}).
inline torch::nn::Sequential model(int layers) {
  torch::manual_seed(0);
  torch::nn::Sequential s;
  for (int k = 0; k < 2 * layers; ++k) {
    s->push_back(torch::nn::Linear(512, 512));
    s->push_back(torch::nn::ReLU());
  }
  return s;
}

inline torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

/// What one variant trains with: one training step on `x`, `y` (the rank's rows), and the
/// parameters of this rank's stage.
struct Trainer {
  std::function<void(const torch::Tensor&, const torch::Tensor&)> step;
  std::vector<torch::Tensor> parameters;
};

/// A store prefix no other pipe of the job has used (every rank builds its pipes in the same
/// order, so all agree).
inline std::string fresh_prefix() {
  static int n = 0;
  return "zero/pipe" + std::to_string(n++);
}

/// A 2 x 2 pipe of variant `v` over `job` (its own store prefix), `layers` per stage, with its
/// optimizer.
inline Trainer pipe_trainer(const runtime::Connection& job, int v, int layers) {
  auto dist = distributed::Options()
                  .data_parallel(2)
                  .bucket_bytes(1 << 20)
                  .shard_optimizer_state(v == kSharded || v == kShardedFused || v == kZero2Fused)
                  .shard_gradients(v == kZero2Fused)
                  .transport(runtime::C10dOptions().prefix(fresh_prefix()));
  auto pipe = std::make_shared<distributed::Pipe>(
      job, model(layers), balance{2 * layers, 2 * layers},
      PipeOptions().chunks(kChunks).checkpoint(Checkpoint::never), dist);
  const bool fused = v == kFused || v == kShardedFused || v == kZero2Fused;
  Trainer t;
  t.parameters = (*pipe)->parameters();
  const auto adam = torch::optim::AdamOptions(1e-4);
  if (fused) {
    auto f = std::make_shared<optim::FusedStep>((*pipe)->parameters(), adam);
    t.step = [pipe, f](const torch::Tensor& x, const torch::Tensor& y) {
      (*pipe)->train_step(x, y, mse, *f, schedule::one_f_one_b{});
    };
    return t;
  }
  std::shared_ptr<torch::optim::Optimizer> opt;
  if (v == kSharded) {
    opt = std::make_shared<distributed::Sharded<torch::optim::Adam>>(*pipe, adam);
  } else {
    opt = std::make_shared<torch::optim::Adam>((*pipe)->parameters(), adam);
  }
  t.step = [pipe, opt](const torch::Tensor& x, const torch::Tensor& y) {
    (*pipe)->train_step(x, y, mse, schedule::one_f_one_b{});
    opt->step();
    // Gradients freed between steps (LibTorch 1.13's zero_grad() zeroes them), as the fused
    // step leaves them.
    for (auto& p : (*pipe)->parameters()) p.mutable_grad().reset();
  };
  return t;
}

/// A DataParallel of variant `v` (not kZero2Fused) over `job`, of 2 x `layers` layers, with its
/// optimizer.
inline Trainer data_parallel_trainer(const runtime::Connection& job, int v, int layers) {
  auto m = model(layers);
  auto dp = std::make_shared<distributed::DataParallel<torch::nn::Sequential>>(
      job, m,
      distributed::DataParallelOptions().bucket_bytes(1 << 20).shard_optimizer_state(
          v == kSharded || v == kShardedFused));
  Trainer t;
  t.parameters = m->parameters();
  const auto adam = torch::optim::AdamOptions(1e-4);
  if (v == kFused || v == kShardedFused) {
    auto f = std::make_shared<optim::FusedStep>(m->parameters(), adam);
    dp->step_with(*f);
    t.step = [dp, f](const torch::Tensor& x, const torch::Tensor& y) {
      mse(dp->forward(x), y).backward();
    };
    return t;
  }
  std::shared_ptr<torch::optim::Optimizer> opt;
  if (v == kSharded) {
    opt = std::make_shared<distributed::Sharded<torch::optim::Adam>>(*dp, adam);
  } else {
    opt = std::make_shared<torch::optim::Adam>(m->parameters(), adam);
  }
  t.step = [dp, opt, m](const torch::Tensor& x, const torch::Tensor& y) {
    mse(dp->forward(x), y).backward();
    opt->step();
    for (auto& p : m->parameters()) p.mutable_grad().reset();  // as the fused step leaves them
  };
  return t;
}

/// The rank's rows of `global` (replica `replica` of `replicas`).
inline torch::Tensor rows_of(const torch::Tensor& global, int replica, int replicas) {
  const auto n = global.size(0) / replicas;
  return global.narrow(0, replica * n, n);
}

/// The median time of one reduce-scatter of a 4 MiB bucket laid out in `d` equal owner slices by
/// `how` (0 reduce, 1 all_to_all, 2 all_reduce, as runtime::ReduceScatter), or (3) of the
/// unsharded all-reduce, over `group`; in microseconds.
inline double collective_us(const runtime::Collectives& group, int how) {
  const std::int64_t n = 1 << 20;
  runtime::detail::BucketShard shard;
  const int d = group.size();
  for (int o = 0; o < d; ++o) {
    shard.slices.push_back({o * (n / d), o + 1 == d ? n - o * (n / d) : n / d});
  }
  const auto flat = torch::randn({n});
  return median_us(
      [&] {
        if (how == 3) {
          std::vector<at::Tensor> one{flat.clone()};
          group.all_reduce_sum(one)->wait();
          return;
        }
        const auto scatter = static_cast<runtime::ReduceScatter>(how);
        shard.launch(group, scatter, flat.clone());
        for (const auto& w : shard.works) w->wait();
        shard.retire(group.rank(), d, scatter);
        shard.mine = torch::Tensor();
      },
      10, 2);
}

/// One rank of a job (`pipe`: the 2 x 2 pipe's, else DataParallel's). Commands from the parent,
/// two bytes each (kind, variant): 't' times a variant's step on the rank's 64 rows (rank 0
/// answers the median in microseconds); 'm' measures its memory on a 1-row-per-micro-batch step
/// with kLayers per stage, 'M' with kMemoryLayers (every rank answers its rank and its bytes per
/// parameter); 'c' times a reduce-scatter way alone (`collective_us`; rank 0 answers); 'q'
/// quits.
[[noreturn]] inline void rank_main(bool pipe, int rank, int world, int port, int commands,
                                   int answers) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  try {
    auto& meter = counting_allocator();  // before any tensor of the job
    at::set_num_threads(1);
    const auto job = runtime::connect(runtime::rendezvous_env());
    const int replicas = pipe ? 2 : world, replica = pipe ? rank / 2 : rank;
    torch::manual_seed(1);
    const auto x = torch::randn({kRows, 512}), y = torch::randn({kRows, 512});
    const auto sx = rows_of(x, replica, replicas), sy = rows_of(y, replica, replicas);
    // The memory step: 1 row per micro-batch, 2 micro-batches (DataParallel: 1 row).
    const auto mx = rows_of(x.narrow(0, 0, 2 * replicas), replica, replicas);
    const auto my = rows_of(y.narrow(0, 0, 2 * replicas), replica, replicas);
    auto make = [&](int v, int layers) {
      return pipe ? pipe_trainer(job, v, layers) : data_parallel_trainer(job, v, layers);
    };
    std::vector<Trainer> trainers;
    const int variants = pipe ? kVariants : kDataParallelVariants;
    for (int v = 0; v < variants; ++v) trainers.push_back(make(v, kLayers));
    for (std::array<char, 2> c{}; ::read(commands, c.data(), 2) == 2 && c[0] != 'q';) {
      if (c[0] == 'c') {
        const double us = collective_us(job.collectives, c[1]);
        if (rank == 0) {
          [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
        }
        continue;
      }
      if (c[0] == 't') {
        auto& t = trainers[static_cast<std::size_t>(c[1])];
        const double us = median_us([&] { t.step(sx, sy); }, kSteps, 1);
        if (rank == 0) {
          [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
        }
        continue;
      }
      // 'm', 'M': a variant of its own, beside the trainers' state of this process: the bytes it
      // adds from before it was built to its step's peak, after one step made its state.
      const auto before = meter.current();
      {
        auto t = make(c[1], c[0] == 'M' ? kMemoryLayers : kLayers);
        t.step(mx, my);
        meter.reset_peak();
        t.step(mx, my);
        double params = 0;
        for (const auto& p : t.parameters) params += static_cast<double>(p.numel());
        const double answer[2] = {static_cast<double>(rank),
                                  static_cast<double>(meter.peak() - before) / params};
        [[maybe_unused]] auto n = ::write(answers, answer, sizeof answer);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero job rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(stdout);
  ::_exit(code);
}

/// A job of `world` forked ranks and the pipes to command them.
class Job {
 public:
  Job(bool pipe, int world, int port) : world_(world) {
    int answers[2];
    TORCH_CHECK(::pipe(answers) == 0, "distributed_cpu: pipe() failed");
    answers_ = answers[0];
    for (int r = 0; r < world; ++r) {
      int commands[2];
      TORCH_CHECK(::pipe(commands) == 0, "distributed_cpu: pipe() failed");
      const pid_t pid = ::fork();
      if (pid == 0) rank_main(pipe, r, world, port, commands[0], answers[1]);
      commands_.push_back(commands[1]);
      pids_.push_back(pid);
    }
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  /// Rank 0's median step time of variant `v`, in microseconds.
  double time(int v) {
    send('t', v);
    return read_doubles(1)[0];
  }
  /// Rank 0's median time of reduce-scatter way `how` alone (`collective_us`), in microseconds.
  double collective(int how) {
    send('c', how);
    return read_doubles(1)[0];
  }
  /// Every rank's bytes per parameter of variant `v` at its step's peak (`layers` per stage:
  /// kLayers or kMemoryLayers); the largest.
  double bytes_per_param(int v, int layers) {
    send(layers == kMemoryLayers ? 'M' : 'm', v);
    double most = 0;
    const auto answers = read_doubles(static_cast<std::size_t>(2 * world_));
    for (int r = 0; r < world_; ++r) {
      most = std::max(most, answers[static_cast<std::size_t>(2 * r + 1)]);
    }
    return most;
  }
  /// Sends every rank 'q' and reaps them; the number that did not exit cleanly.
  int quit() {
    send('q', 0);
    int failed = 0;
    for (auto pid : pids_) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    pids_.clear();
    return failed;
  }
  ~Job() {
    if (!pids_.empty()) quit();
  }

 private:
  void send(char kind, int v) {
    const char c[2] = {kind, static_cast<char>(v)};
    for (const int fd : commands_) {
      TORCH_CHECK(::write(fd, c, 2) == 2, "distributed_cpu: a sharded job's rank is gone");
    }
  }
  std::vector<double> read_doubles(std::size_t n) {
    std::vector<double> out(n);
    auto* bytes = reinterpret_cast<char*>(out.data());
    for (std::size_t got = 0; got < n * sizeof(double);) {
      const auto k = ::read(answers_, bytes + got, n * sizeof(double) - got);
      TORCH_CHECK(k > 0, "distributed_cpu: a sharded job's rank did not answer (see its error)");
      got += static_cast<std::size_t>(k);
    }
    return out;
  }

  int world_;
  int answers_ = -1;
  std::vector<int> commands_;
  std::vector<pid_t> pids_;
};

}  // namespace stagewise::bench::zero
