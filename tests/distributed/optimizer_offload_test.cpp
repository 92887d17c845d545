// Optimizer state off the device in the distributed pipe: each rank keeps its own stages' state in
// one directory shared by every rank (a FileStore's files named after the rank), and the
// parameters equal the one-process pipe's without it, bit for bit, fused (clipped by the whole
// model's norm) and unfused; the 2-D pipe (2 stages x 2 replicas) with it equals the same 2-D
// pipe without it.
#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/grads.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

// A skip from stage 0 to stage 1 (across ranks).
torch::nn::Sequential skip_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), sw::testing::Stash(), torch::nn::Tanh(),
                               torch::nn::Linear(8, 8), torch::nn::Tanh(), sw::testing::Pop(),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

void expect(bool ok, const std::string& what) {
  TORCH_CHECK(ok, what);
}

std::string temp_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// This rank's state files in `dir`: some, each named after the rank.
void expect_own_files(const std::string& dir, int rank) {
  int mine = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.rfind("rank" + std::to_string(rank) + ".state.", 0) == 0) ++mine;
    expect(name.rfind("state.", 0) != 0, "a state file not named after its rank: " + name);
  }
  expect(mine > 0, "rank " + std::to_string(rank) + " keeps no state file");
}

// `steps` fused steps of a 2-D pipe of 2 stages with its state off the device and of its twin
// without, on the same batches: the losses equal at every step.
template <class P>
void step_both(P& pipe, sw::optim::FusedStep& f, P& ref, sw::optim::FusedStep& ref_f, int steps) {
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({12, 6});
    const auto y = torch::randn({12, 3});
    auto run = [&](P& p, sw::optim::FusedStep& fused) {
      const auto in = p->has_stage(0) ? p->shard(x) : torch::Tensor();
      const auto target = p->has_stage(1) ? p->shard(y) : torch::Tensor();
      return p->train_step(in, target, mse, fused, sched::one_f_one_b{});
    };
    const auto loss = run(pipe, f);
    const auto ref_loss = run(ref, ref_f);
    expect(loss.equal(ref_loss), "step " + std::to_string(step) + ": the losses differ");
  }
}

}  // namespace

TEST_SUITE("distributed optimizer offload") {
  TEST_CASE("ranks keeping their state in files train as the one-process pipe without it") {
    const std::string dir = temp_dir("dist_state");
    auto r = run_ranks(
        2,
        [dir](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (bool fused : {true, false}) {
            auto seq = skip_model();
            auto ref_seq = skip_model();
            const auto options = sw::PipeOptions().chunks(4).checkpoint("except_last");
            sw::distributed::Pipe pipe(
                c, seq, sw::balance{4, 4},
                sw::PipeOptions(options).optimizer_offload(sw::runtime::FileStore(dir), 1.0),
                sw::distributed::Options().transport(
                    sw::runtime::C10dOptions().prefix(std::string("state") + (fused ? "f" : "u"))));
            auto ref = sw::Pipe(ref_seq, sw::balance{4, 4}, options);
            const auto adam = torch::optim::AdamOptions(1e-2);
            // One kind at a time: a FusedStep's hooks would step the unfused run's parameters.
            std::optional<sw::optim::FusedStep> f, ref_f;
            std::optional<sw::optim::OffloadedOptimizer> u;
            std::optional<torch::optim::Adam> ref_u;
            if (fused) {
              f.emplace(pipe->named_parameters(), adam);
              ref_f.emplace(ref->named_parameters(), adam);
            } else {
              u.emplace(pipe->named_parameters(), adam, pipe->offloaded_state());
              ref_u.emplace(ref->parameters(), adam);
            }
            for (int step = 0; step < 3; ++step) {
              torch::manual_seed(100 + step);
              const auto x = torch::randn({12, 6});
              const auto y = torch::randn({12, 3});
              const auto in = pipe->has_stage(0) ? x : torch::Tensor();
              const auto target = pipe->has_stage(1) ? y : torch::Tensor();
              const sched::one_f_one_b s;
              if (fused) {
                pipe->clip_grad_norm_step(
                    *f, [&] { pipe->train_step(in, target, mse, *f, s); }, 0.05);
                ref->clip_grad_norm_step(
                    *ref_f, [&] { ref->train_step(x, y, mse, *ref_f, s); }, 0.05);
              } else {
                pipe->train_step(in, target, mse, s);
                ref->train_step(x, y, mse, s);
                u->step();
                ref_u->step();
                for (auto& p : pipe->parameters()) p.mutable_grad().reset();
                for (auto& p : ref->parameters()) p.mutable_grad().reset();
              }
            }
            std::size_t held = 0;
            for (std::size_t i = 0; i < pipe->parameters().size(); ++i) {
              held += fused ? f->offloaded(i) : u->offloaded(i);
            }
            expect(held == pipe->parameters().size(), "not every parameter's state was offloaded");
            expect_own_files(dir, rank);
            const auto diff =
                sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
            expect(diff.empty(), std::string(fused ? "fused: " : "unfused: ") + diff);
          }
        },
        120s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE("2 stages x 2 replicas with the state off the device equal the 2-D pipe without it") {
    const std::string dir = temp_dir("state_2d");
    const auto r = run_ranks(
        4,
        [dir](int rank) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          auto seq = skip_model();
          auto ref_seq = skip_model();
          const auto options = sw::PipeOptions().chunks(3).checkpoint("always");
          auto dist = [](const std::string& prefix) {
            return sw::distributed::Options().data_parallel(2).transport(
                sw::runtime::C10dOptions().prefix(prefix).timeout(20s));
          };
          sw::distributed::Pipe pipe(
              c, seq, sw::balance{4, 4},
              sw::PipeOptions(options).optimizer_offload(sw::runtime::FileStore(dir), 0.5),
              dist("state2d"));
          sw::distributed::Pipe ref(c, ref_seq, sw::balance{4, 4}, options, dist("plain2d"));
          const auto adam = torch::optim::AdamOptions(1e-2);
          sw::optim::FusedStep f(pipe->named_parameters(), adam),
              ref_f(ref->named_parameters(), adam);
          step_both(pipe, f, ref, ref_f, 2);
          std::size_t held = 0;
          for (std::size_t i = 0; i < f.size(); ++i) held += f.offloaded(i);
          expect(held > 0 && held < f.size(), "half the state: some parameters, not all");
          expect_own_files(dir, rank);
          const auto diff =
              sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
          expect(diff.empty(), diff);
        },
        120s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE("sharded replicas with their shares of the state off the device equal them without") {
    const std::string dir = temp_dir("state_sharded");
    const auto r = run_ranks(
        4,
        [dir](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          auto seq = skip_model();
          auto ref_seq = skip_model();
          const auto options = sw::PipeOptions().chunks(3).checkpoint("except_last");
          auto dist = [](const std::string& prefix) {
            return sw::distributed::Options().data_parallel(2).shard_optimizer_state(true).transport(
                sw::runtime::C10dOptions().prefix(prefix).timeout(20s));
          };
          sw::distributed::Pipe pipe(
              c, seq, sw::balance{4, 4},
              sw::PipeOptions(options).optimizer_offload(sw::runtime::HostStore(), 1.0),
              dist("shardstate"));
          sw::distributed::Pipe ref(c, ref_seq, sw::balance{4, 4}, options, dist("shardplain"));
          const auto adam = torch::optim::AdamOptions(1e-2);
          sw::optim::FusedStep f(pipe->named_parameters(), adam),
              ref_f(ref->named_parameters(), adam);
          step_both(pipe, f, ref, ref_f, 3);
          pipe->wait_parameters();
          ref->wait_parameters();
          const auto diff =
              sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
          expect(diff.empty(), diff);
        },
        120s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }
}
