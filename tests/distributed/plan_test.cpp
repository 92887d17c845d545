// distributed::Pipe(model, plan): the pipe plan_pipeline chose, on ranks (one replica, and two
// replicas with the cap per rank), trains as the one-process Pipe(model, plan) does; the plan's
// schedule places the stages on ranks.
#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <string>

namespace sw = stagewise;
using namespace std::chrono_literals;

namespace {

torch::nn::Sequential model() {
  torch::manual_seed(4);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(16, 16));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }

// The same plan on every rank: a V schedule (two stages per rank) when `v`, else 1F1B.
sw::PipelinePlan plan_for(bool v, const torch::Tensor& x, const torch::Tensor& y) {
  return sw::plan_pipeline(model(), sw::Batch(x), y, mse,
                           sw::PlanOptions().workers(2).memory_per_worker(64 << 20).rounds(1)
                               .micro_batches({4}).schedules({v ? "v_half" : "one_f_one_b"}));
}

void expect(bool ok, const std::string& what) { TORCH_CHECK(ok, what); }

void check_ranks(int world, int replicas) {
  const auto r = sw::testing::run_ranks(
      world,
      [replicas](int) {
        auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
        torch::manual_seed(9);
        const auto x = torch::randn({16, 16}), y = torch::randn({16, 16});
        for (bool v : {false, true}) {
          // Each rank plans alone, for its replica's rows; the plan (split, schedule,
          // micro-batches) is the same.
          const auto rows = x.size(0) / replicas;
          const auto plan = plan_for(v, x.narrow(0, 0, rows), y.narrow(0, 0, rows));
          auto seq = model();
          sw::distributed::Pipe pipe(
              c, seq, plan,
              sw::distributed::Options().data_parallel(replicas).transport(
                  sw::runtime::C10dOptions().prefix(std::string("plan") + (v ? "v" : "1"))));
          // The reference is the plan every rank runs (rank 0's), which this rank's own may
          // not be where two candidates were close.
          expect(pipe->plan().has_value(), "the pipe keeps no plan");
          auto ref_seq = model();
          auto ref = sw::Pipe(ref_seq, *pipe->plan());
          const int n = pipe->num_stages();
          if (v) expect(pipe->has_stage(pipe->pipeline_rank() == 0 ? n - 1 : 1),
                        "the V schedule's placement was not used");
          const auto loss =
              pipe->train_step(pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor(),
                               pipe->has_stage(n - 1) ? pipe->shard(y) : torch::Tensor(), mse);
          const auto want = ref->train_step(x, y, mse);
          if (replicas == 1) {
            expect(torch::equal(loss, want), "the loss differs from the one-process pipe's");
            const auto theirs = ref->named_parameters();
            for (const auto& p : pipe->named_parameters()) {
              expect(p.value().grad().equal(theirs[p.key()].grad()), p.key() + "'s gradient differs");
            }
          } else {
            expect(torch::allclose(loss, want, 1e-6, 1e-6),
                   std::string(v ? "V-Half" : "1F1B") + ": the loss " +
                       std::to_string(loss.item<double>()) + " differs from " +
                       std::to_string(want.item<double>()));
          }
        }
      },
      120s);
  for (int k = 0; k < world; ++k) {
    CAPTURE(k);
    CHECK(r[static_cast<std::size_t>(k)].text == "");
    CHECK(r[static_cast<std::size_t>(k)].status == 0);
  }
}

}  // namespace

TEST_SUITE("distributed::Pipe(model, plan)") {
  TEST_CASE("on 2 ranks, as the one-process pipe of the same plan, 1F1B and V-Half") {
    check_ranks(2, 1);
  }
  TEST_CASE("2 stages x 2 replicas: the plan's cap is per rank") { check_ranks(4, 2); }
}
