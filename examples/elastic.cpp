// elastic: a job that outlives lost ranks. Each start plans for the ranks it has (plan_pipeline
// with ranks(N): stages x replicas on the job's measured link), the job saves after every step, and a start after a failure resumes from the
// last complete save, whatever plan (ranks, split, schedule) wrote it.
//   ./bazelw build //examples:elastic
//   tools/launch -n 4 --elastic 2 -- bazel-bin/examples/elastic --fail-at=3
// Rank 3 dies at step 3 (as with a lost machine; on the first start only); tools/launch starts
// the job again on 2 ranks, which plan for 2 and go on from the save of step 2.
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

namespace sw = stagewise;

int train(int argc, char** argv) {
  const char* tmp = std::getenv("TEST_TMPDIR");  // under bazel test, its own directory
  std::string out = tmp ? std::string(tmp) + "/elastic" : "elastic_ckpt";
  int steps = 8, fail_at = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--out=", 0) == 0)
      out = a.substr(6);
    else if (a.rfind("--steps=", 0) == 0)
      steps = std::stoi(a.substr(8));
    else if (a.rfind("--fail-at=", 0) == 0)
      fail_at = std::stoi(a.substr(10));
    else
      return std::cerr << "usage: elastic [--out=DIR] [--steps=N] [--fail-at=STEP]\n", 2;
  }
  auto env = [](const char* name) {
    return std::atoi(std::getenv(name) ? std::getenv(name) : "0");
  };
  const int ranks = env("WORLD_SIZE"), rank = env("RANK");
  const bool restarted = env("TORCHELASTIC_RESTART_COUNT") > 0;  // tools/launch and torchrun set it

  at::set_num_threads(1);
  torch::manual_seed(0);  // every rank builds the same model and data
  using namespace torch::nn;
  Sequential model(Linear(32, 64), ReLU(), Linear(64, 64), ReLU(), Linear(64, 64), ReLU(),
                   Linear(64, 64), Linear(64, 4));
  const auto x = torch::randn({64, 32}), y = torch::randn({64, 4});
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
    return torch::mse_loss(o, t);
  };

  // The fastest plan for the ranks of this start: stages x replicas, weighed on this job's link
  // (every rank runs rank 0's plan).
  auto job = sw::runtime::connect(sw::runtime::rendezvous_env(), {std::chrono::seconds(60)});
  const auto plan = sw::plan_pipeline(model, x, y, loss_fn,
                                      sw::PlanOptions()
                                          .ranks(ranks)
                                          .link(sw::distributed::measure_link(job))
                                          .memory_per_worker(256LL << 20)
                                          .fused_step(true));
  sw::distributed::Pipe pipe(job, model, plan);
  sw::optim::FusedStep fused(pipe->parameters(), torch::optim::AdamOptions(1e-3));
  const auto rows = pipe->shard(x), targets = pipe->shard(y);  // this replica's rows

  std::int64_t first = 0;
  if (const auto last = sw::latest_save(out)) {  // the last complete save, of any plan
    first = pipe->load(last->dir, fused) + 1;
    if (rank == 0) {
      std::cout << "resumed from " << last->dir << " (saved by " << last->processes
                << " ranks) at step " << first << " on " << ranks
                << " ranks: " << pipe->plan()->schedule.name() << ", " << pipe->plan()->workers
                << " stages x " << pipe->plan()->replicas << " replicas" << std::endl;
    }
  }
  for (std::int64_t step = first; step < steps; ++step) {
    if (step == fail_at && !restarted && rank == ranks - 1) std::raise(SIGKILL);  // a lost machine
    const auto loss = pipe->train_step(rows, targets, loss_fn, fused);  // the planned schedule
    pipe->save(out + "/step-" + std::to_string(step), fused, step);
    if (rank == 0) {
      std::filesystem::remove_all(out + "/step-" + std::to_string(step - 2));  // keep two
      std::cout << "step " << step << " on " << ranks << " ranks: loss " << loss.item<double>()
                << std::endl;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const c10::Error& e) {  // e.g. another rank is gone: this one stops, and launch restarts
    std::cerr << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
