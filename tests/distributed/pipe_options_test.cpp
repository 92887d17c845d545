// PipeOptions in the distributed pipe: deferred batch norm equals the one-process pipe bit for bit
// (each rank's batch norms commit their running statistics once per mini-batch), and a wrong
// device count is refused with the one-process pipe's text. Every option in every kind of pipe,
// refusals included: option_matrix_test.cpp.
#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/grads.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

torch::nn::Sequential batch_norm_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

void expect(bool ok, const std::string& what) { TORCH_CHECK(ok, what); }

}  // namespace

TEST_SUITE("distributed pipe options") {
  TEST_CASE("deferred batch norm: parameters and running statistics equal the one-process pipe") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          for (auto schedule : {0, 1}) {
            auto seq = batch_norm_model();
            auto ref_seq = batch_norm_model();
            const auto options =
                sw::PipeOptions().chunks(4).checkpoint("except_last").deferred_batch_norm(true);
            sw::distributed::Pipe pipe(
                c, seq, sw::balance{3, 3}, options,
                sw::distributed::Options().transport(
                    sw::runtime::C10dOptions().prefix("dbn" + std::to_string(schedule))));
            auto ref = sw::Pipe(ref_seq, sw::balance{3, 3}, options);
            torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.1));
            torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
            for (int step = 0; step < 3; ++step) {
              torch::manual_seed(100 + step);
              const auto x = torch::randn({12, 6});
              const auto y = torch::randn({12, 3});
              const auto in = pipe->has_stage(0) ? x : torch::Tensor();
              const auto target = pipe->has_stage(1) ? y : torch::Tensor();
              if (schedule == 0) {
                pipe->train_step(in, target, mse, sched::one_f_one_b{});
                ref->train_step(x, y, mse, sched::one_f_one_b{});
              } else {
                pipe->train_step(in, target, mse, sched::zero_bubble_h1{});
                ref->train_step(x, y, mse, sched::zero_bubble_h1{});
              }
              opt.step();
              opt.zero_grad();
              ref_opt.step();
              ref_opt.zero_grad();
            }
            // Every parameter and buffer of this rank's stage (running mean, variance and count
            // included) equals the one-process pipe's, bit for bit.
            const auto diff =
                sw::testing::first_difference(pipe->named_parameters(), ref->named_parameters());
            expect(diff.empty(), diff);
            const auto buffers = pipe->named_buffers();
            const auto ref_buffers = ref->named_buffers();
            int running = 0;
            for (const auto& b : buffers) {
              expect(b.value().equal(ref_buffers[b.key()]), b.key() + " differs");
              running += b.key().find("running_mean") != std::string::npos;
            }
            expect(running == 1, "expected one running mean per rank, got " +
                                     std::to_string(running));
            // Committed once per mini-batch: 3 steps, not 12 micro-batches.
            for (const auto& b : buffers) {
              if (b.key().find("num_batches_tracked") != std::string::npos) {
                expect(b.value().item<int64_t>() == 3,
                       b.key() + " is " + std::to_string(b.value().item<int64_t>()));
              }
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

  TEST_CASE("devices: every rank places its stages as the one-process pipe does, and refuses alike") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {20s});
          const std::vector<torch::Device> cpus{torch::kCPU, torch::kCPU};
          sw::distributed::Pipe pipe(
              c, batch_norm_model(), sw::balance{3, 3}, sw::PipeOptions().chunks(2).devices(cpus),
              sw::distributed::Options().transport(sw::runtime::C10dOptions().prefix("devices")));
          for (const auto& p : pipe->parameters()) expect(p.device().is_cpu(), "not on the CPU");
          const std::vector<torch::Device> one{torch::kCPU};
          const auto distributed = error_of([&] {
            sw::distributed::Pipe bad(c, batch_norm_model(), sw::balance{3, 3},
                                      sw::PipeOptions().devices(one),
                                      sw::distributed::Options().transport(
                                          sw::runtime::C10dOptions().prefix("devices_bad")));
          });
          const auto local = error_of([&] {
            auto bad = sw::Pipe(batch_norm_model(), sw::balance{3, 3}, sw::PipeOptions().devices(one));
          });
          expect(contains(distributed, "2 stages but only 1 devices; give one device per stage"),
                 distributed);
          expect(contains(local, "2 stages but only 1 devices; give one device per stage"), local);
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].text == "");
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
    }
  }
}
