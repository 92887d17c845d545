// The 2-D distributed pipe: 2 stages x 2 data-parallel replicas on 4 ranks trains as one process
// on the whole batch and as the one-replica pipe on the same global batch, under every schedule
// and checkpoint mode, with a skip across ranks and with the fused step; its layout is printed;
// bad setups and a failing rank of one replica stop every rank of every replica with the cause.

#include "stagewise/distributed.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace dp2 {

constexpr int kReplicas = 2;
constexpr int kRanks = 4;  // 2 ranks per replica x 2 replicas
constexpr int kRows = 12;  // 6 per replica: 3 micro-batches of 2 rows

using sw::testing::Pop;
using sw::testing::Stash;
using sw::testing::Trap;

// Eight layers (balance {4, 4}, or {2, 2, 2, 2} interleaved); with `skip`, layer 1 stashes and
// layer 6 pops, so the skip crosses from the first rank to the last. A different seed per rank
// would not matter: replica 0's parameters are copied to the others at construction.
torch::nn::Sequential model(bool skip, std::uint64_t seed = 7, int width = 8) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(6, width));
  if (skip) {
    s->push_back(Stash());
  } else {
    s->push_back(torch::nn::Tanh());
  }
  s->push_back(torch::nn::Linear(width, 8));
  s->push_back(torch::nn::Tanh());
  s->push_back(torch::nn::Linear(8, 8));
  s->push_back(torch::nn::Tanh());
  if (skip) {
    s->push_back(Pop());
  } else {
    s->push_back(torch::nn::Identity());
  }
  s->push_back(torch::nn::Linear(8, 3));
  return s;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({kRows, 6});
  auto y = torch::randn({kRows, 3});
  return {x, y};
}

void expect(bool ok, const std::string& what) {
  TORCH_CHECK(ok, what);
}

// The largest relative difference seen between a replica's parameters and the references.
double& largest() {
  static double d = 0;
  return d;
}

void expect_close(const torch::Tensor& mine, const torch::Tensor& ref, const std::string& what) {
  const double scale = std::max(ref.abs().max().item<double>(), 1e-6);
  const double diff = (mine - ref).abs().max().item<double>() / scale;
  largest() = std::max(largest(), diff);
  expect(diff <= 1e-5, what + ": relative difference " + std::to_string(diff));
}

enum class Opt { sgd, adam, fused_sgd };

std::unique_ptr<torch::optim::Optimizer> optimizer(Opt kind, std::vector<torch::Tensor> params) {
  if (kind == Opt::adam) {
    return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Trains the 2 x 2 pipe, the one-replica pipe in this process on the whole global batch, and (for
// a model without skips) the plain module on the whole batch, three steps each, and checks the
// losses and this rank's layers against both (1e-5 relative).
template <class Schedule>
void compare(const sw::runtime::Connection& c, const std::string& name, const Schedule& s,
             int virtual_stages, sw::Checkpoint mode, bool skip, Opt kind) {
  // Replica 1 starts from other weights: the construction copies replica 0's.
  auto seq = model(skip, c.env.rank / (kRanks / kReplicas) == 0 ? 7 : 99);
  auto ref_seq = model(skip);
  auto plain = model(skip);
  const auto b = virtual_stages == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  const auto options = sw::PipeOptions().chunks(3).checkpoint(mode);
  auto dist = sw::distributed::Options()
                  .data_parallel(kReplicas)
                  .virtual_stages(virtual_stages)
                  .bucket_bytes(200)  // several buckets per stage
                  .transport(sw::runtime::C10dOptions().prefix(name).timeout(20s));
  if constexpr (sched::placed_schedule<Schedule>) dist.placed_like(s);
  sw::distributed::Pipe pipe(c, seq, b, options, dist);
  auto ref = sw::Pipe(ref_seq, b, sw::PipeOptions().chunks(3).checkpoint(mode));
  auto ref_opt = optimizer(kind == Opt::adam ? Opt::adam : Opt::sgd, ref->parameters());
  auto plain_opt = optimizer(kind == Opt::adam ? Opt::adam : Opt::sgd, plain->parameters());
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::optional<sw::optim::FusedStep> fused;
  if (kind == Opt::fused_sgd) {
    fused.emplace(pipe->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  } else {
    opt = optimizer(kind, pipe->parameters());
  }
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    const bool first = pipe->has_stage(0), last = pipe->has_stage(pipe->num_stages() - 1);
    const auto in = first ? pipe->shard(x) : torch::Tensor();
    const auto target = last ? pipe->shard(y) : torch::Tensor();
    torch::Tensor loss;
    if (fused) {
      loss = pipe->train_step(in, target, mse, *fused, s);
    } else {
      loss = pipe->train_step(in, target, mse, s);
      opt->step();
      opt->zero_grad();
    }
    auto ref_loss = ref->train_step(x, y, mse, s);
    ref_opt->step();
    ref_opt->zero_grad();
    const auto what = name + ", step " + std::to_string(step);
    expect_close(loss, ref_loss, what + ": the loss against the one-replica pipe's");
    if (!skip) {
      auto plain_loss = mse(plain->forward(x), y);
      plain_loss.backward();
      plain_opt->step();
      plain_opt->zero_grad();
      expect_close(loss, plain_loss.detach(), what + ": the loss against one process's");
    }
  }
  int layer = 0;
  for (std::size_t j = 0; j < b.size(); ++j) {
    for (int k = 0; k < b[j]; ++k, ++layer) {
      if (!pipe->has_stage(static_cast<int>(j))) continue;
      const auto l = static_cast<std::size_t>(layer);
      auto mine = seq[l]->parameters();
      auto theirs = ref_seq[l]->parameters();
      auto whole = plain[l]->parameters();
      for (std::size_t p = 0; p < mine.size(); ++p) {
        const auto what = name + ": layer " + std::to_string(layer) + " after three steps";
        expect_close(mine[p], theirs[p], what + " against the one-replica pipe");
        if (!skip) expect_close(mine[p], whole[p], what + " against one process");
      }
    }
  }
}

const char* mode_name(sw::Checkpoint m) {
  return m == sw::Checkpoint::always ? "always" : m == sw::Checkpoint::never ? "never" : "except";
}

void expect_all_passed(const std::vector<sw::testing::RankOutcome>& r) {
  for (std::size_t k = 0; k < r.size(); ++k) {
    CAPTURE(k);
    CHECK(r[k].text == "");
    CHECK(r[k].status == 0);
  }
}

}  // namespace dp2

TEST_SUITE("distributed pipe x data parallel") {
  TEST_CASE("2 stages x 2 replicas equal one process and the one-replica pipe, every schedule") {
    auto r = run_ranks(
        dp2::kRanks,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (auto mode :
               {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
            const std::string m = dp2::mode_name(mode);
            dp2::compare(c, "gpipe-" + m, sched::gpipe{}, 1, mode, false, dp2::Opt::sgd);
            dp2::compare(c, "1f1b-" + m, sched::one_f_one_b{}, 1, mode, false, dp2::Opt::sgd);
            dp2::compare(c, "zb-" + m, sched::zero_bubble_h1{}, 1, mode, false, dp2::Opt::sgd);
            dp2::compare(c, "il-" + m, sched::interleaved_one_f_one_b{2}, 2, mode, false,
                         dp2::Opt::sgd);
            dp2::compare(c, "vh-" + m, sched::v_half{}, 2, mode, false, dp2::Opt::sgd);
            dp2::compare(c, "vm-" + m, sched::v_min{}, 2, mode, false, dp2::Opt::sgd);
          }
          dp2::compare(c, "adam-1f1b", sched::one_f_one_b{}, 1, sw::Checkpoint::except_last, false,
                       dp2::Opt::adam);
          std::printf("rank %d: largest relative difference %.3g\n", rank, dp2::largest());
          std::fflush(stdout);
        },
        300s);
    dp2::expect_all_passed(r);
  }

  TEST_CASE("a skip across ranks and the fused step, with 2 replicas") {
    auto r = run_ranks(
        dp2::kRanks,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          const auto except = sw::Checkpoint::except_last;
          dp2::compare(c, "skip-gpipe", sched::gpipe{}, 1, sw::Checkpoint::always, true,
                       dp2::Opt::sgd);
          dp2::compare(c, "skip-1f1b", sched::one_f_one_b{}, 1, except, true, dp2::Opt::sgd);
          dp2::compare(c, "skip-zb", sched::zero_bubble_h1{}, 1, sw::Checkpoint::never, true,
                       dp2::Opt::sgd);
          dp2::compare(c, "skip-il", sched::interleaved_one_f_one_b{2}, 2, except, true,
                       dp2::Opt::sgd);
          dp2::compare(c, "fused-gpipe", sched::gpipe{}, 1, sw::Checkpoint::always, false,
                       dp2::Opt::fused_sgd);
          dp2::compare(c, "fused-1f1b", sched::one_f_one_b{}, 1, except, false,
                       dp2::Opt::fused_sgd);
          dp2::compare(c, "fused-zb", sched::zero_bubble_h1{}, 1, sw::Checkpoint::never, false,
                       dp2::Opt::fused_sgd);
          dp2::compare(c, "fused-il", sched::interleaved_one_f_one_b{2}, 2, except, false,
                       dp2::Opt::fused_sgd);
          dp2::compare(c, "fused-skip-vm", sched::v_min{}, 2, except, true, dp2::Opt::fused_sgd);
          dp2::compare(c, "fused-skip-1f1b", sched::one_f_one_b{}, 1, except, true,
                       dp2::Opt::fused_sgd);
          std::printf("rank %d: largest relative difference %.3g\n", rank, dp2::largest());
          std::fflush(stdout);
        },
        300s);
    dp2::expect_all_passed(r);
  }

  TEST_CASE("the layout names every rank's replica, stages and rows; shard gives them") {
    auto r = run_ranks(
        dp2::kRanks,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          sw::distributed::Pipe pipe(c, dp2::model(false), sw::balance{4, 4}, {},
                                     sw::distributed::Options().data_parallel(2));
          auto rows = torch::arange(8);
          report(pipe->layout() + std::to_string(pipe->replica()) + " " +
                 std::to_string(pipe->pipeline_rank()) + " " +
                 std::to_string(pipe->shard(rows)[0].item<std::int64_t>()) + "\n" +
                 error_of([&] { pipe->shard(torch::arange(7)); }));
        },
        60s);
    const std::string layout =
        "stagewise::distributed::Pipe: 2 stages on 2 ranks per replica x 2 replicas = 4 ranks\n"
        "rank 0: replica 0, stages 0; gives the input; rows [0/2, 1/2) of each global batch "
        "(shard)\n"
        "rank 1: replica 0, stages 1; gives the target; rows [0/2, 1/2) of each global batch "
        "(shard)\n"
        "rank 2: replica 1, stages 0; gives the input; rows [1/2, 2/2) of each global batch "
        "(shard)\n"
        "rank 3: replica 1, stages 1; gives the target; rows [1/2, 2/2) of each global batch "
        "(shard)\n";
    const std::string uneven =
        "stagewise::distributed::Pipe::shard: the batch has 7 rows, which do not split evenly "
        "over 2 replicas (unequal shares would weight rows unequally); give a multiple of 2 rows";
    CHECK(r[0].text == layout + "0 0 0\n" + uneven);
    CHECK(r[1].text == layout + "0 1 0\n" + uneven);
    CHECK(r[2].text == layout + "1 0 4\n" + uneven);
    CHECK(r[3].text == layout + "1 1 4\n" + uneven);
  }

  TEST_CASE("save and load with 2 replicas resume bit for bit") {
    // TEST_TMPDIR is private to each run of the test (Bazel runs several at once).
    const char* tmp = std::getenv("TEST_TMPDIR");
    const auto dir =
        std::filesystem::path(tmp ? tmp : std::filesystem::temp_directory_path().string()) /
        ("stagewise_dp_save_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    auto r = run_ranks(
        dp2::kRanks,
        [dir](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          auto seq = dp2::model(false);
          sw::distributed::Pipe pipe(c, seq, sw::balance{4, 4}, sw::PipeOptions().chunks(3),
                                     sw::distributed::Options().data_parallel(2));
          torch::optim::Adam adam(pipe->parameters(), torch::optim::AdamOptions(1e-2));
          auto run = [&](int step) {
            auto [x, y] = dp2::batch(step);
            pipe->train_step(pipe->shard(x), pipe->shard(y), dp2::mse, sched::one_f_one_b{});
            adam.step();
            adam.zero_grad();
          };
          run(0);
          pipe->save(dir.string(), adam, 0);
          run(1);
          std::vector<torch::Tensor> after;
          for (const auto& p : pipe->parameters()) after.push_back(p.detach().clone());
          dp2::expect(pipe->load(dir.string(), adam) == 0, "the saved step");
          run(1);
          const auto now = pipe->parameters();
          for (std::size_t k = 0; k < now.size(); ++k) {
            dp2::expect(torch::equal(now[k], after[k]), "resumed parameters differ");
          }
        },
        120s);
    std::filesystem::remove_all(dir);
    dp2::expect_all_passed(r);
  }

  TEST_CASE("bad setups are named on every rank: world size, different models, unequal rows") {
    auto r = run_ranks(
        3,
        [](int) {
          report(error_of([] {
            sw::distributed::Pipe(dp2::model(false), sw::balance{4, 4}, {},
                                  sw::distributed::Options().data_parallel(2).timeout(20s));
          }));
        },
        60s);
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            "stagewise::distributed::Pipe: the pipe has 2 stages on 2 ranks per replica and "
            "Options::data_parallel(2) replicas, so it runs on 4 ranks, but WORLD_SIZE is 3; start "
            "4 ranks (tools/launch -n 4), or change data_parallel, the balance or the virtual "
            "stages");
    }
    r = run_ranks(
        dp2::kRanks,
        [](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          std::string out;
          // Replica 1 (ranks 2 and 3) builds a wider first layer.
          out += error_of([&] {
                   sw::distributed::Pipe(c, dp2::model(false, 7, rank >= 2 ? 9 : 8),
                                         sw::balance{4, 4}, {},
                                         sw::distributed::Options().data_parallel(2).transport(
                                             sw::runtime::C10dOptions().prefix("odd")));
                 }) +
                 "\n";
          sw::distributed::Pipe pipe(c, dp2::model(false), sw::balance{4, 4},
                                     sw::PipeOptions().chunks(2),
                                     sw::distributed::Options().data_parallel(2).timeout(20s));
          // Replica 1 is given 4 rows, replica 0 the 6 of its shard.
          auto [x, y] = dp2::batch(0);
          auto rows = [&](const torch::Tensor& t) {
            return rank >= 2 ? t.narrow(0, 0, 4) : pipe->shard(t);
          };
          out += error_of([&] { pipe->train_step(rows(x), rows(y), dp2::mse); });
          report(out);
        },
        60s);
    const std::string different =
        "stagewise::distributed: ranks 0 and 2 built different stage 0: rank 0 has {0.weight "
        "Float [8, 6]; 0.bias Float [8]; 2.weight Float [8, 8]; 2.bias Float [8]}, rank 2 has "
        "{0.weight Float [9, 6]; 0.bias Float [9]; 2.weight Float [8, 9]; 2.bias Float [8]}; "
        "every rank must build the same model and balance\n";
    const std::string unequal =
        "stagewise::distributed::Pipe::train_step: the 2 replicas were given different numbers "
        "of rows (10 in all, this replica ";
    for (int k = 0; k < dp2::kRanks; ++k) {
      CAPTURE(k);
      const auto& text = r[static_cast<std::size_t>(k)].text;
      CHECK(text.starts_with(different));
      INFO(text);
      // Its own error, or another rank's that reached it first ("rank r failed: ...").
      CHECK(contains(text, unequal));
      CHECK(contains(text,
                     "give every replica the same number of rows "
                     "(pipe->shard(global_batch))"));
    }
  }

  TEST_CASE("a stage that throws on one replica stops every rank of every replica, no hang") {
    auto r = run_ranks(
        dp2::kRanks,
        [](int rank) {
          auto seq = dp2::model(false);
          dp2::Trap trap;
          trap->at = rank == 3 ? 1 : -1;  // replica 1's last stage, in its second micro-batch
          seq->push_back(trap);
          sw::distributed::Pipe pipe(seq, sw::balance{4, 5},
                                     sw::PipeOptions().chunks(3).checkpoint(sw::Checkpoint::never),
                                     sw::distributed::Options().data_parallel(2).timeout(20s));
          auto [x, y] = dp2::batch(0);
          report(error_of([&] {
            pipe->train_step(pipe->shard(x), pipe->shard(y), dp2::mse, sched::one_f_one_b{});
          }));
        },
        60s);
    CHECK(r[3].text == "trap sprung in forward (stagewise: stage 1, micro-batch 1, forward)");
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(
          text.starts_with("stagewise: rank 3 failed: trap sprung in forward (stagewise: stage "
                           "1, micro-batch 1, forward). Rank " +
                           std::to_string(k) + " stops too."));
    }
  }

  TEST_CASE("a rank of one replica killed mid-step stops every rank of both, naming it") {
    auto r = run_ranks(
        dp2::kRanks,
        [](int rank) {
          auto seq = dp2::model(false);
          dp2::Trap trap;
          trap->at = rank == 1 ? 1 : -1;  // replica 0's last stage
          trap->kill = true;
          seq->push_back(trap);
          sw::distributed::Pipe pipe(seq, sw::balance{4, 5}, sw::PipeOptions().chunks(3),
                                     sw::distributed::Options().data_parallel(2).timeout(20s));
          auto [x, y] = dp2::batch(0);
          report(error_of(
              [&] { pipe->train_step(pipe->shard(x), pipe->shard(y), dp2::mse, sched::gpipe{}); }));
        },
        90s);
    CHECK(r[1].status == -SIGKILL);
    for (int k : {0, 2, 3}) {
      CAPTURE(k);
      const auto& text = r[static_cast<std::size_t>(k)].text;
      INFO(text);
      CHECK(!r[static_cast<std::size_t>(k)].timed_out);
      CHECK(contains(text, "rank 1"));
      CHECK(contains(text, "Rank " + std::to_string(k) + " stops too."));
    }
  }
}
