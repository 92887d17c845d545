// What both pipes do around a step (pipe/detail/step.hpp), alone: the row checks as a distributed
// rank makes them (input only, target only), the loss weights, and the fused-step wrapping.

#include "stagewise/pipe/detail/step.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::error_of;

namespace {

const char* who = "stagewise::distributed::Pipe::train_step";

// Records what a pipe asks of its fused step.
struct FakeFused {
  std::vector<std::string> calls;
  void set_accumulation_steps(int k) { calls.push_back("steps " + std::to_string(k)); }
  void finish_step() { calls.push_back("finish"); }
  void reset_step() { calls.push_back("reset"); }
};

}  // namespace

TEST_SUITE("step checks shared by both pipes") {
  TEST_CASE("a rank that holds only the target checks the target's rows alone") {
    const sw::Batch target(std::vector<torch::Tensor>{torch::zeros({4, 2}), torch::zeros({3})});
    CHECK(error_of([&] { sw::detail::check_step_rows(nullptr, &target, who); }) ==
          "stagewise::distributed::Pipe::train_step: target tensor 1 has 3 rows but target tensor "
          "0 has 4; every tensor of the target must have one row per example");
    const sw::Batch empty(torch::zeros({0, 2}));
    CHECK(error_of([&] { sw::detail::check_step_rows(nullptr, &empty, who); }) ==
          "stagewise::distributed::Pipe::train_step: the batch is empty (the target has 0 rows); "
          "a step needs at least one row, so skip empty batches");
    const sw::Batch fine(torch::zeros({4, 2}));
    CHECK(error_of([&] { sw::detail::check_step_rows(nullptr, &fine, who); }) == "(no error)");
  }

  TEST_CASE("a rank that holds only the input checks the input alone") {
    const sw::Batch scalar(torch::tensor(1.0));
    CHECK(error_of([&] { sw::detail::check_step_rows(&scalar, nullptr, who); }) ==
          "stagewise::distributed::Pipe::train_step: the input is a scalar; give a tensor whose "
          "first dimension is the batch (unsqueeze(0) it)");
    const sw::Batch undefined(torch::Tensor{});
    CHECK(error_of([&] { sw::detail::check_step_rows(&undefined, nullptr, who); }) ==
          "stagewise::distributed::Pipe::train_step: the input is undefined; give a tensor whose "
          "first dimension is the batch");
    CHECK(error_of([&] { sw::detail::check_step_rows(nullptr, nullptr, who); }) == "(no error)");
  }

  TEST_CASE("each micro-batch's loss weighs its share of the rows") {
    const std::vector<sw::Batch> micro{sw::Batch(torch::zeros({3, 1})),
                                       sw::Batch(torch::zeros({3, 1})),
                                       sw::Batch(torch::zeros({1, 1}))};
    CHECK(sw::detail::row_weights(micro) == std::vector<double>{3.0 / 7, 3.0 / 7, 1.0 / 7});
  }

  TEST_CASE("a fused step is told the micro-batches, finished after success, reset after failure") {
    FakeFused fused;
    auto loss = sw::detail::with_fused_step(fused, [](const auto& before) {
      before(4);
      return torch::ones({});
    });
    CHECK(loss.item<float>() == 1.0f);
    CHECK(fused.calls == std::vector<std::string>{"steps 4", "finish"});
    fused.calls.clear();
    CHECK_THROWS_AS(sw::detail::with_fused_step(fused,
                                                [](const auto& before) -> torch::Tensor {
                                                  before(2);
                                                  throw std::runtime_error("stage failed");
                                                }),
                    std::runtime_error);
    CHECK(fused.calls == std::vector<std::string>{"steps 2", "reset"});
  }
}
