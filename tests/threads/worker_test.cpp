#include "stagewise/threads/worker.hpp"
#include "stagewise/pipe.hpp"
#include "tests/support/autocast.hpp"
#include "tests/support/threads.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;

using sw::testing::settled_thread_count;
using sw::testing::stable_thread_count;

TEST_SUITE("workers") {
  TEST_CASE("a worker runs posted tasks in order on its own thread") {
    std::vector<int> order;
    std::thread::id ran_on;
    {
      sw::Worker w;
      for (int i = 0; i < 5; ++i) {
        w.post([&, i] {
          order.push_back(i);
          ran_on = std::this_thread::get_id();
        });
      }
    }  // the destructor runs what is queued, then joins
    CHECK(order == std::vector<int>{0, 1, 2, 3, 4});
    CHECK(ran_on != std::this_thread::get_id());
  }

  TEST_CASE("a worker runs each task with its poster's intra-op thread count") {
    const int before = at::get_num_threads();
    at::set_num_threads(1);
    int seen = 0;
    {
      sw::Worker w;
      w.post([&] { seen = at::get_num_threads(); });
    }
    CHECK(seen == 1);
    at::set_num_threads(before);
  }

  TEST_CASE("one worker per stage, joined when the pipe goes away, even after a stage threw") {
    const auto before = stable_thread_count();
    {
      auto fails = [](const torch::Tensor&) -> torch::Tensor {
        throw std::runtime_error("stage failed");
      };
      auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails, torch::nn::Linear(2, 2)),
                           sw::PipeOptions().chunks(2));
      CHECK(settled_thread_count(before + 3) == before + 3);
      CHECK_THROWS_AS(pipe->forward(torch::rand({2, 2})), std::runtime_error);
      CHECK_THROWS_AS(pipe->train_step(torch::rand({2, 2}), torch::rand({2, 2}),
                                       [](const torch::Tensor& o, const torch::Tensor& t) {
                                         return torch::mse_loss(o, t);
                                       }),
                      std::runtime_error);
    }
    CHECK(settled_thread_count(before) == before);
  }

  TEST_CASE("workers inherit the caller's thread-local state: grad mode and CPU autocast") {
    std::atomic<int> grad_enabled{-1};
    std::atomic<int> autocast{-1};
    auto probe = [&](const torch::Tensor& x) {
      grad_enabled = torch::GradMode::is_enabled();
      autocast = sw::testing::cpu_autocast_enabled();
      return x;
    };
    auto pipe = sw::Pipe(sw::stages(probe), sw::PipeOptions().chunks(1));
    {
      torch::NoGradGuard no_grad;
      sw::testing::set_cpu_autocast(true);
      pipe->forward(torch::rand({1, 1}));
      sw::testing::set_cpu_autocast(false);
    }
    CHECK(grad_enabled == 0);
    CHECK(autocast == 1);
    pipe->forward(torch::rand({1, 1}));
    CHECK(grad_enabled == 1);
    CHECK(autocast == 0);
  }
}
