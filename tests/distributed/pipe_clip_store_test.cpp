// A clipped step leaves nothing in the job's store (issue #43): pipe->clip_grad_norm_step gathers
// the ranks' gradient norms over the process group, so 1,000 clipped steps on 2 ranks (100 on 2
// stages x 2 replicas) leave the store's key count where the first step left it, each step's
// total norm still the one-process pipe's (bit for bit with one replica). A clip whose ranks
// disagree (max_norm, or a fused step over parameters outside a rank's stages) is refused on
// every rank, naming the rank.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace clip_store {

// Two stages of one small layer each: a step costs little more than its messages.
torch::nn::Sequential model() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

const auto sgd = torch::optim::SGDOptions(1e-3);

sw::distributed::Options options(const std::string& prefix, int replicas) {
  return sw::distributed::Options().data_parallel(replicas).transport(
      sw::runtime::C10dOptions().prefix(prefix).timeout(20s));
}

// Runs `steps` clipped steps on the distributed pipe (`replicas` replicas of 2 stages), the first
// three also on the one-process pipe over the whole batch, whose total norms they must equal (bit
// for bit with one replica, within 1e-6 relative with two; tests/distributed/pipe_clip_test.cpp
// checks more). Reports the store's key count after the first step and after the last:
// "<first> <last>".
void run(const sw::runtime::Connection& c, int replicas, int steps) {
  TORCH_CHECK(static_cast<bool>(c.across_job()), "the job's connection has no collectives");
  sw::distributed::Pipe pipe(c, model(), sw::balance{2, 1}, sw::PipeOptions().chunks(2),
                             options("keys", replicas));
  auto ref = sw::Pipe(model(), sw::balance{2, 1}, sw::PipeOptions().chunks(2));
  sw::optim::FusedStep fused(pipe->parameters(), sgd), ref_fused(ref->parameters(), sgd);
  torch::manual_seed(5);
  const auto x = torch::randn({4 * replicas, 3}) * 4, y = torch::randn({4 * replicas, 2});
  const auto in = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
  const auto target = pipe->has_stage(1) ? pipe->shard(y) : torch::Tensor();
  const double exact = replicas == 1 ? 0.0 : 1e-6;
  std::int64_t first = -1;
  for (int step = 0; step < steps; ++step) {
    const auto r =
        pipe->clip_grad_norm_step(fused, [&] { pipe->train_step(in, target, mse, fused); }, 0.01);
    if (step < 3) {
      const auto want = ref->clip_grad_norm_step(
          ref_fused, [&] { ref->train_step(x, y, mse, ref_fused); }, 0.01);
      TORCH_CHECK(std::abs(r.total_norm - want.total_norm) <= exact * want.total_norm, "step ",
                  step, ": total norm ", r.total_norm, " but the one-process pipe's is ",
                  want.total_norm);
    }
    if (step == 0) first = c.store->getNumKeys();
  }
  report(std::to_string(first) + " " + std::to_string(c.store->getNumKeys()));
}

// Every rank ran its steps and saw the store's key count unchanged after the first step.
void expect_no_growth(const std::vector<sw::testing::RankOutcome>& outcomes) {
  for (std::size_t k = 0; k < outcomes.size(); ++k) {
    CAPTURE(k);
    CAPTURE(outcomes[k].text);
    CHECK(outcomes[k].status == 0);
    std::istringstream counts(outcomes[k].text);
    std::int64_t first = -1, last = -1;
    counts >> first >> last;
    CHECK(first > 0);
    CHECK(last == first);
  }
}

}  // namespace clip_store

TEST_SUITE("a clipped step over the process group, not the store") {
  TEST_CASE("1,000 clipped steps on 2 ranks leave the store's key count as the first left it") {
    const auto r = run_ranks(
        2,
        [](int) {
          clip_store::run(sw::runtime::connect(sw::runtime::rendezvous_env(), {20s}), 1, 1000);
        },
        180s);
    clip_store::expect_no_growth(r);
  }

  TEST_CASE("100 clipped steps on 2 stages x 2 replicas leave the store's key count alone") {
    const auto r = run_ranks(
        4,
        [](int) {
          clip_store::run(sw::runtime::connect(sw::runtime::rendezvous_env(), {20s}), 2, 100);
        },
        180s);
    clip_store::expect_no_growth(r);
  }

  TEST_CASE("ranks that clip differently are refused on every rank, naming the rank") {
    const auto r = run_ranks(
        2,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          torch::manual_seed(5);
          const auto x = torch::randn({4, 3}), y = torch::randn({4, 2});
          sw::distributed::Pipe pipe(c, clip_store::model(), sw::balance{2, 1},
                                     sw::PipeOptions().chunks(2), clip_store::options("max", 1));
          const auto in = rank == 0 ? x : torch::Tensor(), target = rank == 1 ? y : torch::Tensor();
          sw::optim::FusedStep fused(pipe->parameters(), clip_store::sgd);
          auto step = [&] { pipe->train_step(in, target, clip_store::mse, fused); };
          report(error_of([&] { pipe->clip_grad_norm_step(fused, step, rank == 0 ? 1.0 : 0.5); }));
          report("\n");
          // Rank 0's fused step also holds a tensor of no stage's.
          sw::distributed::Pipe other(c, clip_store::model(), sw::balance{2, 1},
                                      sw::PipeOptions().chunks(2), clip_store::options("out", 1));
          auto params = other->parameters();
          if (rank == 0) params.push_back(torch::zeros({2}, torch::requires_grad()));
          sw::optim::FusedStep outside(params, clip_store::sgd);
          report(error_of([&] {
            other->clip_grad_norm_step(
                outside, [&] { other->train_step(in, target, clip_store::mse, outside); }, 1.0);
          }));
        },
        60s);
    const std::string who = "stagewise::distributed::Pipe::clip_grad_norm_step: ";
    const std::string outside =
        who +
        "on rank 0, the fused step has 1 of its 3 parameters outside this rank's stages; build it "
        "over pipe->parameters() (or a part of them)";
    CHECK(sw::testing::of(r, 0).status == 0);
    CHECK(sw::testing::of(r, 0).text ==
          who +
              "rank 1 clips with max_norm 0.5 and norm_type 2 but this rank with 1 and 2; every "
              "rank must pass the same\n" +
              outside);
    CHECK(sw::testing::of(r, 1).status == 0);
    CHECK(sw::testing::of(r, 1).text ==
          who +
              "rank 0 clips with max_norm 1 and norm_type 2 but this rank with 0.5 and 2; every "
              "rank must pass the same\n" +
              outside);
  }
}
