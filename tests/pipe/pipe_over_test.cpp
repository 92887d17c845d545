// The one pipe over a transport of the test's own (tests/support/wire_transport.hpp: one header
// over the public runtime::pipe_transport concept, and `using WirePipe = PipeOver<WireEnd>`).
// Two "ranks" run in one process, each keeping one stage of the same model: the step must equal
// the one-process Pipe bit for bit, with exactly the messages the plan sends across, the step
// values shared from the right rank, a failure on one rank reaching both, and the pipe must
// refuse a transport or a schedule that places the stages otherwise. The shared transport tests
// (transport_suite_test.cpp) run over it too.

#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/pipe.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/transport.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"
#include "stagewise/stage/partition.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/wire_transport.hpp"

#include <doctest/doctest.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sw = stagewise;

namespace {

using sw::testing::Wire;
using sw::testing::WireEnd;
using sw::testing::WirePipe;

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               torch::nn::ReLU(), torch::nn::Linear(8, 3));
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Runs one step on both ranks at once (rank 0 gives the input, rank 1 the target); returns each
// rank's loss, or its error's text.
template <class Step0, class Step1>
std::array<std::string, 2> both(Step0 step0, Step1 step1, std::array<torch::Tensor, 2>& losses) {
  std::array<std::string, 2> errors{"", ""};
  auto run = [&](int r, auto step) {
    try {
      losses[static_cast<std::size_t>(r)] = step();
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  };
  std::thread t0([&] { run(0, step0); });
  std::thread t1([&] { run(1, step1); });
  t0.join();
  t1.join();
  return errors;
}

}  // namespace

TEST_SUITE("one pipe over any transport") {
  TEST_CASE("two ranks over a test wire equal the one-process pipe bit for bit") {
    torch::manual_seed(3);
    auto seq = mlp();
    auto ref_seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    const auto x = torch::randn({8, 6});
    const auto y = torch::randn({8, 3});
    const auto options = sw::PipeOptions().chunks(4).checkpoint(sw::Checkpoint::always);
    auto ref = sw::Pipe(torch::nn::Sequential(ref_seq), sw::balance{3, 2}, options);
    auto wire = std::make_shared<Wire>();
    WirePipe rank0(seq, sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 0));
    WirePipe rank1(seq, sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 1));
    CHECK(rank0->parameters().size() == 4);  // stage 0's two Linears
    CHECK(rank1->parameters().size() == 2);

    for (int step = 0; step < 2; ++step) {
      const auto want = ref->train_step(x, y, mse, sw::schedule::one_f_one_b{});
      std::array<torch::Tensor, 2> losses;
      const auto errors = both(
          [&] { return rank0->train_step(x, torch::Tensor(), mse, sw::schedule::one_f_one_b{}); },
          [&] { return rank1->train_step(torch::Tensor(), y, mse, sw::schedule::one_f_one_b{}); },
          losses);
      REQUIRE(errors[0] == "");
      REQUIRE(errors[1] == "");
      CHECK(torch::equal(losses[0], want));  // rank 0 gets rank 1's loss through share
      CHECK(torch::equal(losses[1], want));
    }
    const auto params = seq->parameters();
    const auto ref_params = ref_seq->parameters();
    REQUIRE(params.size() == ref_params.size());
    for (std::size_t k = 0; k < params.size(); ++k) {
      CAPTURE(k);
      CHECK(torch::equal(params[k].grad(), ref_params[k].grad()));
    }
    // Each step: 4 activations cross 0 -> 1 and 4 gradients 1 -> 0; nothing else.
    CHECK(rank0->traffic().messages_sent == 8);
    CHECK(rank0->traffic().messages_received == 8);
    CHECK(rank1->traffic().messages_sent == 8);
    CHECK(rank1->traffic().messages_received == 8);
    // One begin_step per step; the count shared from stage 0's rank, the loss from stage 1's.
    const std::vector<std::pair<int, int>> shares{{0, 0}, {1, 1}, {0, 0}, {1, 1}};
    for (const auto* pipe : {&rank0, &rank1}) {
      CHECK((*pipe)->transport().begun() == 2);
      CHECK((*pipe)->transport().shares() == shares);
    }
  }

  TEST_CASE("a memory budget's plan is read from memory_plan(), as from Pipe") {
    auto wire = std::make_shared<Wire>();
    const auto options = sw::PipeOptions().chunks(4).memory_budget(1LL << 30, torch::randn({2, 6}));
    WirePipe rank0(mlp(), sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 0));
    WirePipe rank1(mlp(), sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 1));
    for (const auto* pipe : {&rank0, &rank1}) {
      const auto& plan = (*pipe)->memory_plan();
      CHECK((plan.checkpoints == (*pipe)->resolved_options().checkpoints));
      CHECK((plan.checkpoints == std::vector<sw::Checkpoint>(2, sw::Checkpoint::never)));
      CHECK(plan.predicted_peak.size() == 2);  // one per worker (rank)
    }
    CHECK(rank0->memory_plan().predicted_peak == rank1->memory_plan().predicted_peak);
    WirePipe plain(mlp(), sw::balance{3, 2}, sw::PipeOptions().chunks(4),
                   std::make_unique<WireEnd>(std::make_shared<Wire>(), 0));
    CHECK(sw::testing::error_of([&] { (void)plain->memory_plan(); }) ==
          "stagewise::PipeOver::memory_plan: the pipe has no memory budget; build it from a "
          "Sequential with PipeOptions().memory_budget(bytes, sample)");
  }

  TEST_CASE("a failure on one rank stops both, each with the failing cell named") {
    auto seq = mlp();
    auto wire = std::make_shared<Wire>();
    const auto options = sw::PipeOptions().chunks(2);
    WirePipe rank0(seq, sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 0));
    WirePipe rank1(seq, sw::balance{3, 2}, options, std::make_unique<WireEnd>(wire, 1));
    auto bad_loss = [](const torch::Tensor& out, const torch::Tensor&) -> torch::Tensor {
      (void)out;
      throw std::runtime_error("the loss refuses");
    };
    std::array<torch::Tensor, 2> losses;
    const auto errors = both(
        [&] {
          return rank0->train_step(torch::randn({4, 6}), torch::Tensor(), bad_loss);
        },
        [&] {
          return rank1->train_step(torch::Tensor(), torch::randn({4, 3}), bad_loss);
        },
        losses);
    // Rank 1's loss fails in micro-batch 0's forward; rank 0, waiting for a gradient, fails with
    // it: the pipe rethrows the step's first error (the one the wire gave rank 0's mailbox).
    CHECK(errors[1] == errors[0]);
    CHECK(sw::testing::contains(errors[1], "the loss refuses"));
  }

  TEST_CASE("a transport placing other stages, or a schedule placing them otherwise, is refused") {
    auto wire = std::make_shared<Wire>();
    CHECK(sw::testing::error_of([&] {
            WirePipe(mlp(), sw::balance{2, 2, 1}, {}, std::make_unique<WireEnd>(wire, 0));
          }) ==
          "stagewise::PipeOver: the transport places 2 stages but the balance makes 3; "
          "build the transport for the pipe's stages");
    CHECK(sw::testing::error_of([&] {
            WirePipe(mlp(), sw::balance{3, 2}, {}, nullptr);
          }) == "stagewise::PipeOver: the transport is null; give the pipe one");
    WirePipe rank0(mlp(), sw::balance{3, 2}, {}, std::make_unique<WireEnd>(wire, 0));
    CHECK(rank0->processes().runs(0));
    CHECK_FALSE(rank0->processes().runs(1));
    // ZB-V runs both stages of a 2-stage pipe on one worker: the wire runs them on two ranks.
    CHECK(sw::testing::error_of([&] {
            rank0->train_step(torch::randn({4, 6}), torch::Tensor(), mse,
                              sw::schedule::zero_bubble_v{});
          }) ==
          "stagewise::PipeOver::train_step: the schedule runs the 2 stages on 1 workers but "
          "the pipe runs them on 2 ranks; pass a schedule that runs each process's stages "
          "(the transport's processes()) on a worker of their own");
  }
}
