// What every rank sees when a step fails somewhere: no rank returns from the step (so none runs an
// optimizer step the others did not), and each reports the failing rank's error with its cell,
// whatever the exception's type, even when the failing rank serves the store and exits at once.

#include "stagewise/distributed.hpp"
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace sw = stagewise;
using sw::testing::error_of;
using sw::testing::report;
using sw::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

// Identity forward whose backward throws std::runtime_error (not a c10::Error) at its `at`-th
// call.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g);
};

int backward_calls = 0;
int throw_at = -1;

torch::autograd::variable_list ThrowInBackward::backward(torch::autograd::AutogradContext*,
                                                         torch::autograd::variable_list g) {
  if (backward_calls++ == throw_at) throw std::runtime_error("boom in backward");
  return g;
}

struct BackwardTrapImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return ThrowInBackward::apply(x); }
};
TORCH_MODULE(BackwardTrap);

torch::nn::Sequential model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), BackwardTrap(), torch::nn::Tanh(),
                               torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

}  // namespace

TEST_SUITE("distributed failures") {
  // The case of the issue: rank 1 (the last stage) has done all its work when rank 0 fails at its
  // third backward; rank 1 used to return the loss (and run its optimizer) and fail only in the
  // next step, with "lost the rendezvous store" since rank 0, which serves it, had exited.
  TEST_CASE("a rank failing late in backward fails the step on every rank, with its cell") {
    auto r = run_ranks(
        2,
        [](int rank) {
          throw_at = rank == 0 ? 2 : -1;
          sw::distributed::Pipe pipe(model(), sw::balance{2, 2}, sw::PipeOptions().chunks(4),
                                     sw::distributed::Options().timeout(20s));
          torch::manual_seed(1);
          const auto x = torch::randn({8, 6}), y = torch::randn({8, 3});
          report(error_of([&] { pipe->train_step(x, y, mse, sw::schedule::one_f_one_b{}); }));
        },
        60s);
    CHECK(r[0].text == "boom in backward");
    INFO(r[1].text);
    CHECK(r[1].text ==
          "stagewise: rank 0 failed: boom in backward (stagewise: stage 0, micro-batch 2, "
          "backward). Rank 1 stops too.");
  }

  TEST_CASE("a step that succeeds everywhere returns the same loss on every rank") {
    auto r = run_ranks(
        3,
        [](int) {
          throw_at = -1;
          sw::distributed::Pipe pipe(
              torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(),
                                    torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                    torch::nn::Linear(8, 3)),
              sw::balance{2, 2, 1}, sw::PipeOptions().chunks(4),
              sw::distributed::Options().timeout(20s));
          torch::manual_seed(1);
          const auto x = torch::randn({8, 6}), y = torch::randn({8, 3});
          std::string out;
          for (int step = 0; step < 3; ++step) {
            const auto loss = pipe->train_step(x, y, mse, sw::schedule::gpipe{});
            out += std::to_string(loss.item<float>()) + " ";
          }
          report(out);
        },
        60s);
    CHECK(r[0].status == 0);
    CHECK(r[0].text == r[1].text);
    CHECK(r[1].text == r[2].text);
  }
}
