// Activation offload in the distributed pipe: each rank offloads its own stages' checkpointed
// inputs and popped skips to a file store, and the parameters equal the one-process pipe's without
// offload, bit for bit.
#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/multiprocess.hpp"
#include "tests/support/pipe_layers.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>

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
            const auto mine = pipe->named_parameters();
            const auto theirs = ref->named_parameters();
            for (const auto& p : mine) {
              expect(theirs.contains(p.key()), "no " + p.key() + " in the one-process pipe");
              expect(p.value().equal(theirs[p.key()]), p.key() + " differs");
            }
          }
        },
        120s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }
}
