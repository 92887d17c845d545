// fit_ranks: plan_pipeline(..., PlanOptions().ranks(N)) on a real job of N forked ranks (Gloo on
// loopback, one intra-op thread each). Every rank measures the link (distributed::measure_link)
// and plans for N ranks at a cap every factorisation fits (1.1 x the most any one needs at
// least); then every factorisation the
// planner weighed that fits (its best candidate: K ranks per pipeline x d replicas, sharding,
// schedule, micro-batches) is built with distributed::Pipe(model, plan) and measured: each
// rank's peak in a step (MemoryMeter: a rank is a device) and the job's step time, the
// factorisations alternated in rounds. Rank 0 prints the table and the last line:
//   fit_ranks choice_vs_best=<fastest measured / the plan's measured step>
//             predicted_vs_measured=<the plan's predicted step / measured>
//             cap_respected=<1 if every planned run's measured per-rank peak is within the cap>
//
//   ./bazelw run -c opt //benchmarks:fit_ranks -- [--ranks=2] [--rounds=5] [--steps=5]

#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/flags.hpp"
#include "benchmarks/common/loopback.hpp"
#include "benchmarks/common/stats.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;

namespace {

constexpr int kRows = 64;    // the global batch
constexpr int kWidth = 384;  // 8 x [Linear(384, 384), ReLU]
constexpr int kLayers = 8;

torch::nn::Sequential model() {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < kLayers; ++i) {
    m->push_back(torch::nn::Linear(kWidth, kWidth));
    m->push_back(torch::nn::ReLU());
  }
  return m;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::mse_loss(a, b);
}

sw::PlanOptions options(int ranks, const sw::LinkSpeed& link) {
  return sw::PlanOptions().ranks(ranks).link(link).rounds(2);
}

// One factorisation's best plan, built on the job, with its optimizer.
struct Variant {
  sw::PlanFactorisation shape;
  sw::PipelinePlan plan;  // rank 0's, once built
  std::shared_ptr<sw::distributed::Pipe> pipe;
  std::shared_ptr<sw::optim::FusedStep> fused;
  std::shared_ptr<torch::optim::Optimizer> opt;
  std::vector<double> step_seconds;  // per round
  double peak = 0;                   // the most any rank held in a step, bytes
  bool chosen = false;
};

std::string key_of(int k, int d, const std::string& sharding) {
  return std::to_string(k) + "x" + std::to_string(d) + ":" + sharding;
}

// This rank's plan for factorisation `k x d` with `sharding`: its best fitting candidate, else any
// of its candidates, else the chosen plan (distributed::Pipe then takes rank 0's).
sw::PipelinePlan plan_of(const sw::PipelinePlan& plan, int k, int d, const std::string& sharding) {
  const sw::PipelinePlan* any = nullptr;
  for (const auto& c : plan.candidates) {
    if (!c.plan || c.plan->workers != k || c.plan->replicas != d ||
        sw::PipelinePlan::sharding_name(c.plan->shard_optimizer_state, c.plan->shard_gradients) !=
            sharding) {
      continue;
    }
    if (c.fits) return *c.plan;
    if (!any) any = c.plan.get();
  }
  auto out = any ? *any : plan;
  out.workers = k;
  out.replicas = d;
  return out;
}

void build(Variant& v, const sw::runtime::Connection& job, const sw::PipelinePlan& mine,
           const std::string& prefix) {
  v.pipe = std::make_shared<sw::distributed::Pipe>(
      job, model(), mine,
      sw::distributed::Options()
          .timeout(std::chrono::seconds(120))
          .transport(sw::runtime::C10dOptions().prefix(prefix)));
  v.plan = *(*v.pipe)->plan();
  const auto adam = torch::optim::AdamOptions(1e-4);
  if (v.plan.fused_step) {
    v.fused = std::make_shared<sw::optim::FusedStep>((*v.pipe)->parameters(), adam);
  } else if (v.plan.shard_optimizer_state) {
    v.opt = std::make_shared<sw::distributed::Sharded<torch::optim::Adam>>(*v.pipe, adam);
  } else {
    v.opt = std::make_shared<torch::optim::Adam>((*v.pipe)->parameters(), adam);
  }
}

void step(Variant& v, const torch::Tensor& x, const torch::Tensor& y) {
  auto& pipe = *v.pipe;
  const int n = pipe->num_stages();
  const auto in = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
  const auto target = pipe->has_stage(n - 1) ? pipe->shard(y) : torch::Tensor();
  if (v.fused) {
    pipe->train_step(in, target, mse, *v.fused);
    return;
  }
  pipe->train_step(in, target, mse);
  v.opt->step();
  for (auto& p : pipe->parameters()) p.mutable_grad().reset();
}

void barrier(const sw::runtime::Connection& job) {
  std::vector<at::Tensor> one{torch::zeros({1})};
  job.collectives.all_reduce_sum(one)->wait();
}

double mib(double bytes) {
  return bytes / (1 << 20);
}

int rank_main(int rank, int world, int rounds, int steps) {
  torch::set_num_threads(1);
  std::optional<sw::bench::Conditions> conditions;
  if (rank == 0) conditions.emplace("fit_ranks");  // the header line: date, load, BLAS, threads
  auto& meter = sw::MemoryMeter::install();
  auto job = sw::runtime::connect(sw::runtime::rendezvous_env(), {std::chrono::seconds(60)});
  const auto link = sw::distributed::measure_link(job);
  torch::manual_seed(1);
  const auto x = torch::randn({kRows, kWidth}), y = torch::randn({kRows, kWidth});
  // The cap: 1.1 times the most any factorisation's smallest plan needs, so that every one fits
  // and the choice is by time (sizes, not times, set it: the same on every rank).
  const auto least = sw::plan_pipeline(
      model(), sw::Batch(x), y, mse,
      options(world, link).memory_per_worker(1LL << 32).prefer(sw::PlanFor::memory));
  double most = 0;
  for (const auto& f : least.factorisations) most = std::max(most, f.peak);
  const auto cap = static_cast<std::int64_t>(1.1 * most / 0.95);
  const auto t0 = std::chrono::steady_clock::now();
  const auto plan =
      sw::plan_pipeline(model(), sw::Batch(x), y, mse, options(world, link).memory_per_worker(cap));
  const double planning =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Rank 0's fitting factorisations, in a fixed order (deepest first), on every rank.
  std::string fitting;
  auto shapes = plan.factorisations;
  std::stable_sort(shapes.begin(), shapes.end(), [](const auto& a, const auto& b) {
    return a.stage_ranks != b.stage_ranks ? a.stage_ranks > b.stage_ranks : a.sharding < b.sharding;
  });
  for (const auto& f : shapes) {
    if (f.fits) fitting += key_of(f.stage_ranks, f.replicas, f.sharding) + ";";
  }
  fitting = sw::runtime::gather_text(job, "fit_ranks/variants", fitting, std::chrono::seconds(120),
                                     "the variants")
                .front();
  std::vector<Variant> variants;
  for (const auto& f : shapes) {
    if (fitting.find(key_of(f.stage_ranks, f.replicas, f.sharding) + ";") == std::string::npos) {
      continue;
    }
    Variant v;
    v.shape = f;
    variants.push_back(v);
  }
  // Memory: each variant alone, its third step's peak over what the process held before it.
  for (std::size_t i = 0; i < variants.size(); ++i) {
    auto& v = variants[i];
    const auto before = meter.current();
    build(v, job, plan_of(plan, v.shape.stage_ranks, v.shape.replicas, v.shape.sharding),
          "fit_ranks/memory" + std::to_string(i));
    for (int s = 0; s < 3; ++s) {
      if (s == 2) meter.reset_peak();
      step(v, x, y);
    }
    const auto measured = meter.peak() - before;
    v.pipe.reset();
    v.fused.reset();
    v.opt.reset();
    const auto all =
        sw::runtime::gather_text(job, "fit_ranks/peak" + std::to_string(i),
                                 std::to_string(measured), std::chrono::seconds(120), "the peaks");
    for (const auto& text : all) v.peak = std::max(v.peak, std::stod(text));
  }
  // Time: every variant built, one warm-up step each, then rounds of `steps` steps per variant,
  // the order rotated each round.
  for (std::size_t i = 0; i < variants.size(); ++i) {
    auto& v = variants[i];
    build(v, job, plan_of(plan, v.shape.stage_ranks, v.shape.replicas, v.shape.sharding),
          "fit_ranks/time" + std::to_string(i));
    step(v, x, y);
  }
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t k = 0; k < variants.size(); ++k) {
      auto& v = variants[(k + static_cast<std::size_t>(r)) % variants.size()];
      barrier(job);
      const auto s0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) step(v, x, y);
      barrier(job);
      v.step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count() / steps);
    }
  }
  if (rank != 0) return 0;
  // The chosen plan is rank 0's: its factorisation's variant.
  for (auto& v : variants) {
    v.chosen = v.plan.workers == plan.workers && v.plan.replicas == plan.replicas &&
               v.plan.shard_optimizer_state == plan.shard_optimizer_state &&
               v.plan.shard_gradients == plan.shard_gradients;
  }
  std::printf(
      "fit_ranks: %d ranks (forked, Gloo on loopback, 1 intra-op thread each), %d x "
      "[Linear(%d,%d), ReLU], batch %d rows, Adam; link measured %s; cap %.2f MiB per "
      "rank (1.1 x the most any factorisation's smallest plan needs); planning took %.2f s on rank "
      "0; %d rounds of %d steps\n\n",
      world, kLayers, kWidth, kWidth, kRows, link.to_string().c_str(), mib(cap), planning, rounds,
      steps);
  std::printf("%s\n", plan.report().c_str());
  std::printf("%-7s %-36s %-15s %3s %-7s %10s %28s %10s %10s %8s\n", "", "factorisation (sharding)",
              "schedule", "M", "step", "predicted", "measured ms [min, max]", "pred. MiB",
              "meas. MiB", "cap MiB");
  double fastest = 1e300, chosen_measured = 0, chosen_predicted = 0;
  bool within = true;
  for (const auto& v : variants) {
    const auto s = sw::bench::summarize(v.step_seconds);
    fastest = std::min(fastest, s.median);
    if (v.chosen) {
      chosen_measured = s.median;
      chosen_predicted = v.plan.step_seconds;
    }
    within = within && v.peak <= static_cast<double>(cap);
    const std::string shape = std::to_string(v.plan.workers) + " x " +
                              std::to_string(v.plan.replicas) + " (" + v.shape.sharding + ")";
    char measured[64];
    std::snprintf(measured, sizeof measured, "%.2f [%.2f, %.2f]", s.median * 1e3, s.min * 1e3,
                  s.max * 1e3);
    std::printf("%-7s %-36s %-15s %3lld %-7s %10.2f %28s %10.2f %10.2f %8.2f\n",
                v.chosen ? "chosen" : "", shape.c_str(), v.plan.schedule.name().c_str(),
                static_cast<long long>(v.plan.micro_batches),
                v.plan.fused_step ? "fused" : "unfused", v.plan.step_seconds * 1e3, measured,
                mib(v.plan.peak()), mib(v.peak), mib(cap));
  }
  std::printf("\n");
  conditions->print_end();
  std::printf(
      "fit_ranks choice_vs_best=%s predicted_vs_measured=%s cap_respected=%d\n",
      sw::bench::fixed3(chosen_measured > 0 ? fastest / chosen_measured : 0).c_str(),
      sw::bench::fixed3(chosen_measured > 0 ? chosen_predicted / chosen_measured : 0).c_str(),
      within ? 1 : 0);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int world = sw::bench::int_flag(argc, argv, "--ranks", 2);
  const int rounds = sw::bench::int_flag(argc, argv, "--rounds", 5);
  const int steps = sw::bench::int_flag(argc, argv, "--steps", 5);
  const int port = sw::bench::free_loopback_port("fit_ranks");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::fprintf(stderr, "fit_ranks: fork() failed\n");
      return 1;
    }
    if (pid == 0) {
      ::alarm(1800);  // a rank never outlives a stuck job by long
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      int code = 1;
      try {
        code = rank_main(rank, world, rounds, steps);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fit_ranks: rank %d: %s\n", rank, e.what());
      }
      std::fflush(stdout);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  if (failed > 0) std::fprintf(stderr, "fit_ranks: %d of %d ranks failed\n", failed, world);
  return failed > 0 ? 1 : 0;
}
