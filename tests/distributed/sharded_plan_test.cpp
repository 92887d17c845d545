// plan_pipeline for a 2-D pipe with sharded state (PlanOptions().replicas(2) and its sharding):
// the plan's predicted peak per worker falls with the sharding (unsharded, ZeRO-1, ZeRO-2), and
// each rank of the 2 stages x 2 replicas pipe built from it holds in a step
// (MemoryMeter: a rank is a device) within 10% of it; a pipe built otherwise than planned is
// refused, naming the options to build it with.

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using namespace std::chrono_literals;

namespace zplan {

constexpr std::int64_t kBucket = 256 << 10;

// 16 x [Linear(256,256), Tanh]: the parameters dominate 1-row micro-batches' activations.
torch::nn::Sequential model() {
  torch::manual_seed(4);
  torch::nn::Sequential m;
  for (int i = 0; i < 16; ++i) {
    m->push_back(torch::nn::Linear(256, 256));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::mse_loss(a, b);
}

// 0 unsharded, 1 sharded state, 2 sharded state and gradients.
sw::PlanOptions plan_options(int sharding) {
  return sw::PlanOptions()
      .workers(2)
      .replicas(2)
      .shard_optimizer_state(sharding >= 1)
      .shard_gradients(sharding == 2)
      .bucket_bytes(kBucket)
      .memory_per_worker(256 << 20)
      .rounds(1)
      .micro_batches({4})
      .schedules({"one_f_one_b"})
      .prefer(sw::PlanFor::memory)  // the split by size: the same on every rank
      .fused_step(true);
}

sw::distributed::Options dist_options(int sharding) {
  return sw::distributed::Options()
      .data_parallel(2)
      .shard_optimizer_state(sharding >= 1)
      .shard_gradients(sharding == 2)
      .bucket_bytes(kBucket)
      .timeout(20s)
      .transport(sw::runtime::C10dOptions().prefix("zplan" + std::to_string(sharding)));
}

}  // namespace zplan

TEST_SUITE("distributed::Pipe(model, plan) with sharded state") {
  TEST_CASE("each rank holds the plan's predicted peak within 10%, and sharding lowers it") {
    const auto r = sw::testing::run_ranks(
        4,
        [](int rank) {
          auto& meter = sw::MemoryMeter::install();  // before the tensors to count
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          torch::manual_seed(9);
          const auto x = torch::randn({8, 256}), y = torch::randn({8, 256});
          std::string out;
          double last = 0;
          for (int sharding = 0; sharding < 3; ++sharding) {
            // Every rank plans alone for its replica's 4 rows.
            const auto plan =
                sw::plan_pipeline(zplan::model(), sw::Batch(x.narrow(0, 0, 4)), y.narrow(0, 0, 4),
                                  zplan::mse, zplan::plan_options(sharding));
            const double predicted =
                plan.memory[static_cast<std::size_t>(rank % 2)].peak;  // this rank's worker's
            const auto before = meter.current();
            {
              sw::distributed::Pipe pipe(c, zplan::model(), plan, zplan::dist_options(sharding));
              sw::optim::FusedStep fused(pipe->parameters(), torch::optim::AdamOptions(1e-3));
              const int n = pipe->num_stages();
              const auto in = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
              const auto target = pipe->has_stage(n - 1) ? pipe->shard(y) : torch::Tensor();
              for (int step = 0; step < 3; ++step) {
                if (step == 2) meter.reset_peak();
                pipe->train_step(in, target, zplan::mse, fused);
              }
              const double measured = static_cast<double>(meter.peak() - before);
              char line[160];
              std::snprintf(line, sizeof line, "sharding %d: measured %.0f of %.0f predicted; ",
                            sharding, measured, predicted);
              // Within 10% of the prediction (as plan_promise_test holds the one-process
              // pipe), and sharding lowers it.
              if (std::abs(measured - predicted) > 0.1 * predicted ||
                  (sharding > 0 && predicted >= last)) {
                out += line;
              }
              std::printf("rank %d %s\n", rank, line);
              std::fflush(stdout);
            }
            last = predicted;
          }
          // Built otherwise than planned.
          const auto plan =
              sw::plan_pipeline(zplan::model(), sw::Batch(x.narrow(0, 0, 4)), y.narrow(0, 0, 4),
                                zplan::mse, zplan::plan_options(2));
          out += error_of([&] {
            sw::distributed::Pipe(c, zplan::model(), plan,
                                  sw::distributed::Options().data_parallel(2).transport(
                                      sw::runtime::C10dOptions().prefix("zplan-other")));
          });
          report(out);
        },
        180s);
    for (const auto& o : r) {
      INFO(o.text);
      CHECK(o.status == 0);
      CHECK(o.text ==
            "stagewise::distributed::Pipe: the plan counts each worker's memory for "
            "data_parallel(2).shard_gradients(true) (PlanOptions().replicas and sharding) but the "
            "pipe is built with data_parallel(2); build it with "
            "distributed::Options().data_parallel(2).shard_gradients(true), or plan for the pipe "
            "you build");
    }
  }
}
