// DataParallel: any module on 2 and 3 ranks, each with its share of every batch, trains as one
// process on the whole batch (up to the order of summation), with accumulation, with parameters
// unused on some steps or some ranks; bad setups are clear errors on every rank.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

constexpr int kSteps = 3;
constexpr int kRows = 12;  // splits evenly over 2 and 3 ranks

// Two heads: `b` only when asked, so that a step can leave its parameters without a gradient.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : body(register_module("body", torch::nn::Linear(6, 8))),
        a(register_module("a", torch::nn::Linear(8, 3))),
        b(register_module("b", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x, bool use_b) {
    auto h = torch::tanh(body->forward(x));
    return use_b ? a->forward(h) + b->forward(h) : a->forward(h);
  }
  torch::nn::Linear body, a, b;
};
TORCH_MODULE(TwoHeads);

// A checkpointed block (its recompute runs in a nested backward) and two towers whose backward
// runs on a thread pool (ParallelBranches): the reduction hooks fire inside both.
struct TowersImpl : torch::nn::Module {
  TowersImpl()
      : body(register_module("body", torch::nn::Linear(6, 8))),
        block(register_module("block", torch::nn::Linear(8, 8))),
        towers(register_module(
            "towers", sw::ParallelBranches(torch::nn::Linear(8, 3), torch::nn::Linear(8, 3)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(body->forward(x));
    h = sw::checkpoint([this](const torch::Tensor& t) { return torch::tanh(block->forward(t)); },
                       h);
    const auto ys = towers->forward(h);
    return ys[0] + ys[1];
  }
  torch::nn::Linear body, block;
  sw::ParallelBranches towers;
};
TORCH_MODULE(Towers);

TwoHeads model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return TwoHeads();
}

struct Batch {
  torch::Tensor x, y;
};
std::vector<Batch> data() {
  torch::manual_seed(42);
  std::vector<Batch> d;
  for (int s = 0; s < kSteps; ++s)
    d.push_back({torch::randn({kRows, 6}), torch::randn({kRows, 3})});
  return d;
}

std::unique_ptr<torch::optim::Optimizer> optimizer(const std::string& kind, TwoHeads& m) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(m->parameters(),
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
}

// Whether step s uses head b on rank r (of w): `pattern` "always", "odd_steps_off" (no rank on
// odd steps), "rank0_only_on_odd" (only rank 0 on odd steps).
bool uses_b(const std::string& pattern, int s, int r) {
  if (pattern == "always") return true;
  if (s % 2 == 0) return true;
  return pattern == "rank0_only_on_odd" && r == 0;
}

// One process on the whole batch, every step (rank-dependent head use applied to each rank's
// rows, as the ranks do).
// `none_grads`: gradients reset to none between steps (LibTorch 2.x's zero_grad; 1.13's zeroes
// them, and Adam then steps a parameter without a gradient), as a fused step leaves them.
TwoHeads reference(const std::string& kind, const std::string& pattern, int world,
                   bool none_grads = false) {
  auto m = model(1);
  auto opt = optimizer(kind, m);
  const auto d = data();
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    if (none_grads) {
      for (auto& p : m->parameters()) p.mutable_grad().reset();
    }
    const auto rows = kRows / world;
    torch::Tensor loss;
    for (int r = 0; r < world; ++r) {
      const auto x = d[s].x.narrow(0, r * rows, rows), y = d[s].y.narrow(0, r * rows, rows);
      // The whole batch's mean: each share's mean weighted by its rows.
      auto part = torch::mse_loss(m->forward(x, uses_b(pattern, s, r)), y) / world;
      loss = loss.defined() ? loss + part : part;
    }
    loss.backward();
    opt->step();
  }
  return m;
}

// max |a - b| / max(|b|, 1e-3) over every parameter, and a digest of `a`'s bytes.
std::string compare(TwoHeads& got, TwoHeads& want) {
  double worst = 0;
  std::uint64_t h = 1469598103934665603ull;
  auto g = got->parameters(), w = want->parameters();
  for (std::size_t i = 0; i < g.size(); ++i) {
    const auto diff = (g[i] - w[i]).abs() / w[i].abs().clamp_min(1e-3);
    worst = std::max(worst, diff.max().item<double>());
    const auto c = g[i].detach().contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t k = 0; k < c.nbytes(); ++k) h = (h ^ p[k]) * 1099511628211ull;
  }
  char out[64];
  std::snprintf(out, sizeof out, "%.3g %016llx", worst, static_cast<unsigned long long>(h));
  return out;
}

// Trains on `world` ranks; each reports "<max relative difference> <digest>".
std::vector<sw::testing::RankOutcome> train(int world, const std::string& kind,
                                            const std::string& pattern, bool accumulate,
                                            sw::distributed::DataParallelOptions options = {}) {
  return run_ranks(
      world,
      [&](int rank) {
        auto m = model(rank == 0 ? 1 : 100 + rank);  // rank 0's parameters reach every rank
        sw::distributed::DataParallel dp(m, options.timeout(10s));
        // "fused_adam": Adam fused into backward, each parameter stepping on its average.
        const bool fused = kind == "fused_adam";
        auto opt = optimizer(fused ? "adam" : kind, m);
        std::unique_ptr<sw::optim::FusedStep> fused_step;
        if (fused) {
          fused_step = std::make_unique<sw::optim::FusedStep>(m->parameters(),
                                                              torch::optim::AdamOptions(1e-2));
          dp.step_with(*fused_step);
        }
        const auto d = data();
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          const auto x = dp.shard(d[s].x), y = dp.shard(d[s].y);
          const bool b = uses_b(pattern, s, rank);
          if (accumulate) {  // two micro-steps, the first without communication
            const auto half = x.size(0) / 2;
            {
              auto local = dp.no_sync();
              (torch::mse_loss(dp.forward(x.narrow(0, 0, half), b), y.narrow(0, 0, half)) / 2)
                  .backward();
            }
            (torch::mse_loss(dp.forward(x.narrow(0, half, half), b), y.narrow(0, half, half)) / 2)
                .backward();
          } else {
            torch::mse_loss(dp.forward(x, b), y).backward();
          }
          if (!fused) opt->step();
        }
        auto want = reference(fused ? "adam" : kind, pattern, world, /*none_grads=*/fused);
        report(compare(m, want));
      },
      60s);
}

double worst_of(const std::string& text) {
  return std::stod(text.substr(0, text.find(' ')));
}
std::string digest_of(const std::string& text) {
  return text.substr(text.find(' ') + 1);
}

void check_equal_to_one_process(const std::vector<sw::testing::RankOutcome>& r) {
  for (const auto& o : r) {
    INFO(o.text);
    REQUIRE(o.status == 0);
    CHECK(worst_of(o.text) < 1e-5);
    CHECK(digest_of(o.text) == digest_of(r[0].text));  // every rank took the same steps
  }
  MESSAGE("largest relative difference to one process: " << worst_of(r[0].text));
}

}  // namespace

TEST_SUITE("data parallel") {
  TEST_CASE("2 and 3 ranks with SGD momentum and Adam equal one process on the whole batch") {
    for (const int world : {2, 3}) {
      for (const std::string kind : {"sgd", "adam"}) {
        CAPTURE(world);
        CAPTURE(kind);
        check_equal_to_one_process(train(world, kind, "always", false));
      }
    }
  }

  TEST_CASE("Adam fused into backward steps each parameter on its average: equal to one process") {
    check_equal_to_one_process(train(2, "fused_adam", "always", false));
    check_equal_to_one_process(train(3, "fused_adam", "always", true));
    check_equal_to_one_process(train(2, "fused_adam", "odd_steps_off", false));
  }

  TEST_CASE("a checkpointed block and parallel towers: hooks in nested and pooled backward") {
    const auto r = run_ranks(
        2,
        [](int rank) {
          torch::manual_seed(rank == 0 ? 1 : 7);
          Towers m;
          torch::manual_seed(1);
          Towers want;
          sw::distributed::DataParallel dp(
              m, sw::distributed::DataParallelOptions().timeout(10s).bucket_bytes(64));
          torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(1e-2));
          torch::optim::Adam adam_want(want->parameters(), torch::optim::AdamOptions(1e-2));
          for (const auto& b : data()) {
            adam.zero_grad();
            torch::mse_loss(dp.forward(dp.shard(b.x)), dp.shard(b.y)).backward();
            adam.step();
            adam_want.zero_grad();
            torch::mse_loss(want->forward(b.x), b.y).backward();
            adam_want.step();
          }
          double worst = 0;
          auto g = m->parameters(), w = want->parameters();
          for (std::size_t i = 0; i < g.size(); ++i) {
            worst = std::max(
                worst, ((g[i] - w[i]).abs() / w[i].abs().clamp_min(1e-3)).max().item<double>());
          }
          report(std::to_string(worst));
        },
        60s);
    for (const auto& o : r) {
      INFO(o.text);
      REQUIRE(o.status == 0);
      CHECK(std::stod(o.text) < 1e-5);
    }
    MESSAGE("checkpoint and ParallelBranches: largest relative difference " << r[0].text);
  }

  TEST_CASE("small buckets (one parameter each) reduce the same") {
    check_equal_to_one_process(
        train(2, "adam", "always", false, sw::distributed::DataParallelOptions().bucket_bytes(4)));
  }

  TEST_CASE("accumulation over two micro-steps with no_sync") {
    check_equal_to_one_process(train(2, "adam", "always", true));
    check_equal_to_one_process(train(3, "sgd", "always", true));
  }

  TEST_CASE("a parameter no rank uses on odd steps keeps its gradient") {
    check_equal_to_one_process(train(2, "adam", "odd_steps_off", false));
    check_equal_to_one_process(train(3, "sgd", "odd_steps_off", true));
  }

  TEST_CASE("a parameter only some ranks use: zeros from the others with unused_parameters") {
    check_equal_to_one_process(
        train(2, "adam", "rank0_only_on_odd", false,
              sw::distributed::DataParallelOptions().unused_parameters(true)));
    check_equal_to_one_process(
        train(3, "sgd", "rank0_only_on_odd", true,
              sw::distributed::DataParallelOptions().unused_parameters(true)));
  }

  TEST_CASE("without unused_parameters, every rank names the parameters only some ranks used") {
    const auto r = run_ranks(
        2,
        [](int rank) {
          auto m = model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
          const auto x = torch::randn({6, 6});
          report(error_of([&] { dp.forward(x, rank == 0).sum().backward(); }));
        },
        60s);
    const std::string text =
        "stagewise::distributed::DataParallel: 2 parameters got a gradient on some ranks but not "
        "on others in this backward (of 2 ranks): parameter 'b.weight' (on 1 rank), parameter "
        "'b.bias' (on 1 rank). Pass "
        "DataParallelOptions().unused_parameters(true) to reduce them with zeros from the others "
        "(what one process on the whole batch computes), or use every parameter on every rank";
    CHECK(r[0].text == text);
    CHECK(r[1].text == text);
  }

  TEST_CASE("bad setups are clear errors on every rank") {
    // A backward that bypasses DataParallel::forward would leave the ranks apart.
    auto r = run_ranks(
        2,
        [](int) {
          auto m = model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
          report(error_of([&] { m->forward(torch::randn({6, 6}), true).sum().backward(); }));
        },
        60s);
    for (const auto& o : r) {
      CHECK(contains(o.text, "stagewise::distributed::DataParallel: parameter '"));
      CHECK(contains(o.text,
                     "' got a gradient in a backward that did not start from a marked "
                     "output, so it would not be averaged over the ranks"));
    }
    // A fused step attached to the parameters would step on each rank's own gradients.
    r = run_ranks(
        2,
        [](int) {
          auto m = model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
          sw::optim::FusedStep fused(m->parameters(), torch::optim::AdamOptions(1e-2));
          report(error_of([&] { dp.forward(torch::randn({6, 6}), true).sum().backward(); }));
        },
        60s);
    for (const auto& o : r) {
      INFO(o.text);
      CHECK(contains(o.text, "stagewise::distributed::DataParallel: parameter '"));
      CHECK(contains(o.text,
                     "got a gradient in this backward, but another hook freed it before "
                     "it was averaged over the ranks (an optim::FusedStep attached to "
                     "these parameters steps on this rank's gradient alone, and the ranks "
                     "drift apart); give the fused step to DataParallel::step_with(fused), "
                     "which steps on the averages"));
    }
    // Replicas that built different models.
    r = run_ranks(
        2,
        [](int rank) {
          torch::nn::Sequential m(torch::nn::Linear(6, rank == 0 ? 3 : 4));
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
        },
        60s);
    for (const auto& o : r) {
      INFO(o.text);
      CHECK(o.status == 1);
      CHECK(contains(o.text,
                     "ranks 0 and 1 built different stage 0: rank 0 has {0.weight Float "
                     "[3, 6]; 0.bias Float [3]}, rank 1 has {0.weight Float [4, 6]; "
                     "0.bias Float [4]}"));
    }
    // A batch that does not split evenly.
    r = run_ranks(
        3,
        [](int) {
          auto m = model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(10s));
          report(error_of([&] { dp.shard(torch::randn({10, 6})); }));
        },
        60s);
    CHECK(r[2].text ==
          "stagewise::distributed::DataParallel::shard: the batch has 10 rows, which do not split "
          "evenly over 3 ranks (unequal shares would weight rows unequally); give a multiple of 3 "
          "rows");
  }

  TEST_CASE("a rank failing in backward stops every rank within the timeout") {
    const auto r = run_ranks(
        2,
        [](int rank) {
          auto m = model(1);
          sw::distributed::DataParallel dp(m, sw::distributed::DataParallelOptions().timeout(5s));
          if (rank == 1) throw std::runtime_error("rank 1 gives up before backward");
          dp.forward(torch::randn({6, 6}), true).sum().backward();
        },
        60s);
    CHECK(r[1].text == "rank 1 gives up before backward");
    INFO(r[0].text);
    CHECK(r[0].status == 1);
    CHECK_FALSE(r[0].timed_out);
  }
}
