// The 2-D distributed pipe (2 stages x 2 replicas on 4 ranks) with a parameter that one replica
// uses and the other does not: with Options().unused_parameters(true) the other replica adds
// zeros, and every rank's gradients are the mean of the replicas' gradients computed in one
// process (with sharded optimizer state, on the parameter's owner only); without it, the step
// fails on every rank of every replica, naming the parameter and the option.

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace unused2d {

// Whether the gate of this process uses its extra layer (replica 0's ranks do, replica 1's not).
bool& gate_open() {
  static bool open = true;
  return open;
}

// x + extra(x) while the gate is open, else x: `extra` gets a gradient in one replica only.
struct GateImpl : torch::nn::Module {
  GateImpl() : extra(register_module("extra", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return gate_open() ? x + extra(x) : x; }
  torch::nn::Linear extra;
};
TORCH_MODULE(Gate);

torch::nn::Sequential model() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), Gate(),
                               torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

// The global batch: 8 rows, 4 per replica.
std::pair<torch::Tensor, torch::Tensor> batch() {
  torch::manual_seed(11);
  return {torch::randn({8, 6}), torch::randn({8, 3})};
}

// Rank `rank` of the 2 x 2 pipe: one 1F1B step; checks the loss and this rank's gradients against
// one process (replica 0's rows with the gate open, replica 1's with it closed, averaged). With
// `shard` (sharded optimizer state), a rank holds the averages of the parameters it owns only.
void train(int rank, bool unused, bool shard = false) {
  auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
  const auto [x, y] = batch();
  auto ref = model();
  gate_open() = true;
  auto loss0 = mse(ref->forward(x.narrow(0, 0, 4)), y.narrow(0, 0, 4));
  gate_open() = false;
  auto loss1 = mse(ref->forward(x.narrow(0, 4, 4)), y.narrow(0, 4, 4));
  const auto want = (loss0 + loss1) / 2;
  want.backward();

  sw::distributed::Pipe pipe(c, model(), sw::balance{2, 2}, sw::PipeOptions().chunks(2),
                             sw::distributed::Options()
                                 .data_parallel(2)
                                 .unused_parameters(unused)
                                 .shard_optimizer_state(shard)
                                 .timeout(20s));
  gate_open() = pipe->replica() == 0;
  // A sharded pipe's gradients go to their owners, whose updates a distributed::Sharded optimizer
  // sends (a reduction without one is refused); built here, not stepped: the test reads gradients.
  std::optional<sw::distributed::Sharded<torch::optim::SGD>> sharded;
  if (shard) sharded.emplace(pipe, torch::optim::SGDOptions(0.1));
  const auto loss =
      pipe->train_step(pipe->shard(x), pipe->shard(y), mse, sw::schedule::one_f_one_b{});
  TORCH_CHECK(torch::allclose(loss, want.detach(), 1e-6, 1e-7), "rank ", rank, ": loss ",
              loss.item<double>(), ", one process ", want.item<double>());
  const auto refs = ref->named_parameters();
  int checked = 0;
  const auto owned = shard ? pipe->sharded_parameters().owned : std::vector<char>();
  std::size_t k = 0;
  for (const auto& p : pipe->named_parameters()) {
    // "stage<j>.<layer>...": the same layer of the reference is "<layer>...".
    const auto name = p.key().substr(p.key().find('.') + 1);
    const auto& r = refs[name];
    if (shard && !owned[k++]) {  // another replica's: its gradient was freed here
      TORCH_CHECK(!p.value().grad().defined(), "rank ", rank, ": ", p.key(),
                  " is not this replica's but kept a gradient");
      continue;
    }
    const double scale = std::max(r.grad().abs().max().item<double>(), 1e-6);
    const double diff = (p.value().grad() - r.grad()).abs().max().item<double>() / scale;
    TORCH_CHECK(diff <= 1e-5, "rank ", rank, ": ", p.key(), " differs by ", diff);
    ++checked;
  }
  TORCH_CHECK(checked > 0, "rank ", rank, " has no parameters");
  (void)rank;
}

}  // namespace unused2d

TEST_SUITE("distributed pipe x data parallel, unused parameters") {
  TEST_CASE("a parameter one replica leaves unused: zeros from it with unused_parameters") {
    const auto r = run_ranks(
        4, [](int rank) { unused2d::train(rank, true); }, 120s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(sw::testing::of(r, k).text == "");
      CHECK(sw::testing::of(r, k).status == 0);
    }
  }

  TEST_CASE("with sharded state: each parameter's owner gets that average, the others free it") {
    const auto r = run_ranks(
        4, [](int rank) { unused2d::train(rank, true, /*shard=*/true); }, 120s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(sw::testing::of(r, k).text == "");
      CHECK(sw::testing::of(r, k).status == 0);
    }
  }

  TEST_CASE("without unused_parameters, every rank of every replica names it and the fix") {
    const auto r = run_ranks(
        4, [](int rank) { report(error_of([&] { unused2d::train(rank, false); })); }, 120s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      const auto& text = sw::testing::of(r, k).text;
      CHECK(contains(text, "parameter 'stage1.2.extra.weight' (on 1 rank)"));
      CHECK(contains(text, "distributed::Options().unused_parameters(true)"));
    }
  }
}
