// Activation offload in the distributed pipe: each rank offloads its own stages' checkpointed
// inputs and popped skips to a file store, and the parameters equal the one-process pipe's without
// offload, bit for bit; the 2-D pipe (2 stages x 2 data-parallel replicas, all four ranks sharing
// one directory) with offload equals the same 2-D pipe without it, losses and parameters, bit for
// bit.
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

// A 2-D step of `s` (the pipe is data parallel: each replica trains on its shard of the rows).
template <class Pipe>
torch::Tensor step_2d(Pipe& pipe, const torch::Tensor& x, const torch::Tensor& y,
                      const sched::any_schedule& s) {
  const auto in = pipe->has_stage(0) ? pipe->shard(x) : torch::Tensor();
  const auto target = pipe->has_stage(pipe->num_stages() - 1) ? pipe->shard(y) : torch::Tensor();
  return pipe->train_step(in, target, mse, s);
}

// Rank `rank` of 2 ranks per replica x 2 replicas, `v` stages per rank: under `s`, the pipe
// offloading every stage's checkpointed cells to `dir` (shared by all four ranks: ranks 0 and 2
// run the same stages, as do ranks 1 and 3) and the same 2-D pipe without offload train two Adam
// steps alike, losses and parameters bit for bit; each rank's files are its own, named after it,
// and removed with its pipe.
void offload_2d(const sw::runtime::Connection& c, const std::string& dir, const std::string& name,
                const sched::any_schedule& s, int v) {
  const int rank = c.env.rank;
  auto seq = skip_model();
  auto ref_seq = skip_model();
  const auto b = v == 2 ? sw::balance{2, 2, 2, 2} : sw::balance{4, 4};
  const auto options = sw::PipeOptions().chunks(3).checkpoint("always");
  const sched::OffloadCosts every{.costs = {.offload = 0.0},
                                  .stages = std::vector<bool>(b.size(), true)};
  auto dist = [&](const std::string& prefix) {
    return sw::distributed::Options().data_parallel(2).virtual_stages(v).placed_like(s).transport(
        sw::runtime::C10dOptions().prefix(name + prefix).timeout(20s));
  };
  std::vector<std::string> files;
  {
    sw::distributed::Pipe pipe(c, seq, b,
                               sw::PipeOptions(options).offload(sw::runtime::FileStore(dir), every),
                               dist("/offload"));
    sw::distributed::Pipe ref(c, ref_seq, b, options, dist("/plain"));
    torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({12, 6});
      const auto y = torch::randn({12, 3});
      const auto loss = step_2d(pipe, x, y, s);
      const auto ref_loss = step_2d(ref, x, y, s);
      expect(loss.equal(ref_loss), name + ", step " + std::to_string(step) + ": loss " +
                                       std::to_string(loss.item<double>()) + ", without offload " +
                                       std::to_string(ref_loss.item<double>()));
      opt.step();
      opt.zero_grad();
      ref_opt.step();
      ref_opt.zero_grad();
    }
    const auto diff =
        sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
    expect(diff.empty(), name + ": " + diff);
    // This rank's files, named after it: the replicas running one stage never share one.
    for (int j = 0; j < pipe->num_stages(); ++j) {
      const auto file =
          dir + "/rank" + std::to_string(rank) + ".stage" + std::to_string(j) + ".offload";
      if (std::filesystem::exists(file)) {
        expect(pipe->has_stage(j), name + ": " + file + " is not this rank's stage");
        files.push_back(file);
      }
      expect(!std::filesystem::exists(dir + "/stage" + std::to_string(j) + ".offload"),
             name + ": a stage file not named after its rank");
    }
    expect(!files.empty(), name + ": rank " + std::to_string(rank) + " offloaded nothing");
  }
  for (const auto& file : files) {
    expect(!std::filesystem::exists(file), name + ": " + file + " outlived its pipe");
  }
}

}  // namespace

TEST_SUITE("distributed offload") {
  TEST_CASE("offloading ranks train as the one-process pipe without offload, bit for bit") {
    const char* base = std::getenv("TEST_TMPDIR");
    const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_dist_offload";
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    auto r = run_ranks(
        2,
        [dir](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (int schedule : {0, 1}) {
            auto seq = skip_model();
            auto ref_seq = skip_model();
            const auto options = sw::PipeOptions().chunks(4).checkpoint("always");
            const sched::OffloadCosts every{.costs = {.offload = 0.0}, .stages = {true, true}};
            sw::distributed::Pipe pipe(
                c, seq, sw::balance{4, 4},
                sw::PipeOptions(options).offload(sw::runtime::FileStore(dir), every),
                sw::distributed::Options().transport(
                    sw::runtime::C10dOptions().prefix("offload" + std::to_string(schedule))));
            auto ref = sw::Pipe(ref_seq, sw::balance{4, 4}, options);
            torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.1));
            torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
            for (int step = 0; step < 3; ++step) {
              torch::manual_seed(100 + step);
              const auto x = torch::randn({12, 6});
              const auto y = torch::randn({12, 3});
              const auto in = pipe->has_stage(0) ? x : torch::Tensor();
              const auto target = pipe->has_stage(1) ? y : torch::Tensor();
              torch::manual_seed(200 + step);
              if (schedule == 0) {
                pipe->train_step(in, target, mse, sched::one_f_one_b{});
              } else {
                pipe->train_step(in, target, mse, sched::zero_bubble_h1{});
              }
              torch::manual_seed(200 + step);
              if (schedule == 0) {
                ref->train_step(x, y, mse, sched::one_f_one_b{});
              } else {
                ref->train_step(x, y, mse, sched::zero_bubble_h1{});
              }
              opt.step();
              opt.zero_grad();
              ref_opt.step();
              ref_opt.zero_grad();
            }
            const auto diff =
                sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
            expect(diff.empty(), diff);
          }
        },
        120s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }

  TEST_CASE(
      "2 stages x 2 replicas with offload to one shared directory equal the 2-D pipe "
      "without it, bit for bit, every schedule kind") {
    const char* base = std::getenv("TEST_TMPDIR");
    const std::string dir = std::string(base ? base : "/tmp") + "/stagewise_offload_2d";
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const auto r = run_ranks(
        4,
        [dir](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          offload_2d(c, dir, "gpipe", sched::any_schedule("gpipe", sched::gpipe{}), 1);
          offload_2d(c, dir, "1f1b", sched::any_schedule("1f1b", sched::one_f_one_b{}), 1);
          offload_2d(c, dir, "zb", sched::any_schedule("zb", sched::zero_bubble_h1{}), 1);
          offload_2d(c, dir, "il", sched::any_schedule("il", sched::interleaved_one_f_one_b{2}), 2);
          offload_2d(c, dir, "vh", sched::any_schedule("vh", sched::v_half{}), 2);
        },
        240s);
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }
}
