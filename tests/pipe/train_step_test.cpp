#include "stagewise/pipe.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/schedule_fixture.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3));
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.grad().clone());
  return out;
}

struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               std::function<void()>* on_backward) {
    ctx->saved_data["hook"] = reinterpret_cast<int64_t>(on_backward);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    (*reinterpret_cast<std::function<void()>*>(ctx->saved_data["hook"].toInt()))();
    return {g[0], torch::Tensor()};
  }
};

struct ExpectedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

TEST_SUITE("train_step") {
  TEST_CASE("gradients and loss equal unpipelined training on the same micro-batches, every mode") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      const std::string mode_name = sw::to_string(mode);
      CAPTURE(mode_name);
      torch::manual_seed(3);
      auto seq = mlp();
      auto x = torch::randn({10, 6});  // 10 rows in 4 chunks: 3, 3, 3, 1
      auto t = torch::randn({10, 3});
      auto expected_loss = sw::testing::reference_step(*seq, x, t, 4);
      auto expected = grads_of(*seq);
      seq->zero_grad();

      auto pipe = sw::Pipe(seq, sw::balance{2, 3, 2}, sw::PipeOptions().chunks(4).checkpoint(mode));
      auto loss = pipe->train_step(x, t, mse);
      CHECK(loss.item<float>() == expected_loss.item<float>());
      auto got = grads_of(*seq);
      for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
      // Whole-batch training agrees up to float rounding.
      seq->zero_grad();
      auto whole = mse(seq->forward(x), t);
      whole.backward();
      CHECK(loss.item<float>() == doctest::Approx(whole.item<float>()).epsilon(1e-6));
      auto full = grads_of(*seq);
      for (std::size_t k = 0; k < got.size(); ++k)
        CHECK(torch::allclose(got[k], full[k], 1e-5, 1e-6));
    }
  }

  TEST_CASE("gradients accumulate across steps like repeated backward calls") {
    torch::manual_seed(4);
    auto seq = mlp();
    auto x = torch::randn({8, 6});
    auto t = torch::randn({8, 3});
    sw::testing::reference_step(*seq, x, t, 2);
    sw::testing::reference_step(*seq, x, t, 2);
    auto expected = grads_of(*seq);
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, sw::balance{3, 4}, sw::PipeOptions().chunks(2));
    pipe->train_step(x, t, mse);
    pipe->train_step(x, t, mse);
    auto got = grads_of(*seq);
    for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
  }

  TEST_CASE("a step's plan is kept, and made again when the batch splits otherwise") {
    // Batches of 8, 3 (3 micro-batches of 4 chunks), 8 again and 3 again, under 1F1B with every
    // cell checkpointed: the kept plans (4 and 3 micro-batches) run each step as a fresh pipe
    // would, so the gradients equal the unpipelined steps'.
    torch::manual_seed(8);
    auto seq = mlp();
    std::vector<torch::Tensor> xs, ts;
    for (int rows : {8, 3, 8, 3}) {
      xs.push_back(torch::randn({rows, 6}));
      ts.push_back(torch::randn({rows, 3}));
    }
    for (std::size_t k = 0; k < xs.size(); ++k) {
      sw::testing::reference_step(*seq, xs[k], ts[k], 4, /*ascending=*/true);  // as 1F1B
    }
    auto expected = grads_of(*seq);
    seq->zero_grad();
    auto pipe = sw::Pipe(seq, sw::balance{3, 4}, sw::PipeOptions().chunks(4).checkpoint("always"));
    for (std::size_t k = 0; k < xs.size(); ++k) {
      sw::schedule::Timeline timeline;
      pipe->train_step(xs[k], ts[k], mse, sw::schedule::one_f_one_b{}, &timeline);
      int forwards = 0;
      for (const auto& e : timeline.actions) forwards += e.action.kind == sw::schedule::ActionKind::forward;
      CHECK(forwards == 2 * static_cast<int>(std::min<std::int64_t>(4, xs[k].size(0))));
    }
    auto got = grads_of(*seq);
    for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
  }

  TEST_CASE("dropout is replayed exactly by the recompute") {
    for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last}) {
      auto seq = torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Dropout(0.5),
                                       torch::nn::Linear(16, 3));
      auto x = torch::randn({8, 6});
      auto t = torch::randn({8, 3});
      torch::manual_seed(11);
      sw::testing::reference_step(*seq, x, t, 4);
      auto expected = grads_of(*seq);
      seq->zero_grad();
      auto pipe = sw::Pipe(seq, sw::balance{2, 1}, sw::PipeOptions().chunks(4).checkpoint(mode));
      torch::manual_seed(11);
      pipe->train_step(x, t, mse);
      auto got = grads_of(*seq);
      for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k].equal(expected[k]));
    }
  }

  TEST_CASE("a checkpointed cell is recomputed before its gradient arrives") {
    std::mutex mutex;
    std::vector<std::string> events;
    auto log = [&](std::string e) {
      std::lock_guard<std::mutex> lock(mutex);
      events.push_back(std::move(e));
    };
    int recomputes = 0;
    int backwards = 0;
    std::function<void()> slow = [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      log("B1:" + std::to_string(3 - backwards++));
    };
    auto first = [&](const torch::Tensor& x) {
      if (sw::is_recomputing()) log("R0:" + std::to_string(3 - recomputes++));
      return x * 2;
    };
    auto second = [&](const torch::Tensor& x) { return SlowBackward::apply(x, &slow); };
    auto pipe =
        sw::Pipe(sw::stages(first, second), sw::PipeOptions().chunks(4).checkpoint("always"));
    pipe->train_step(torch::rand({4, 2}, torch::requires_grad()), torch::rand({4, 2}), mse);
    REQUIRE(events.size() == 8);
    auto at = [&](const std::string& e) {
      return std::find(events.begin(), events.end(), e) - events.begin();
    };
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK(at("R0:" + std::to_string(i)) < at("B1:" + std::to_string(i)));
    }
  }

  TEST_CASE("a failure in forward or backward reaches the caller unchanged, and nothing hangs") {
    auto fails_forward = [](const torch::Tensor& x) -> torch::Tensor {
      if (x.size(0) == 1) throw ExpectedError("forward failed");
      return x;
    };
    auto pipe =
        sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails_forward, torch::nn::Linear(2, 2)),
                 sw::PipeOptions().chunks(3));
    CHECK_THROWS_WITH_AS(pipe->train_step(torch::rand({5, 2}), torch::rand({5, 2}), mse),
                         "forward failed", ExpectedError);

    std::function<void()> boom = [] { throw ExpectedError("backward failed"); };
    auto pipe2 = sw::Pipe(sw::stages(
                              torch::nn::Linear(2, 2),
                              [&](const torch::Tensor& x) { return SlowBackward::apply(x, &boom); },
                              torch::nn::Linear(2, 2)),
                          sw::PipeOptions().chunks(3));
    CHECK_THROWS_WITH_AS(pipe2->train_step(torch::rand({6, 2}), torch::rand({6, 2}), mse),
                         "backward failed", ExpectedError);
    // The pipe is still usable afterwards.
    CHECK(pipe->train_step(torch::rand({6, 2}), torch::rand({6, 2}), mse).defined());
  }

  TEST_CASE("bad calls are clear errors") {
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2)), sw::PipeOptions().chunks(2));
    {
      torch::NoGradGuard no_grad;
      CHECK(contains(error_of([&] {
                       pipe->train_step(torch::rand({2, 2}), torch::rand({2, 2}), mse);
                     }),
                     "grad mode is off"));
    }
    CHECK(contains(error_of([&] {
                     pipe->train_step(torch::rand({4, 2}), torch::rand({1, 2}), mse);
                   }),
                   "the target has 1 rows but the input has 4; give one target row per input row"));
    auto empty = sw::Pipe(torch::nn::Sequential(), sw::balance{});
    CHECK(contains(error_of([&] {
                     empty->train_step(torch::rand({2, 2}), torch::rand({2, 2}), mse);
                   }),
                   "the pipe has no stages"));
  }

  TEST_CASE("train_step refuses unequal rows, a loss that is not a scalar and an empty batch") {
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(8, 4)), sw::PipeOptions().chunks(2));
    // Only the number of micro-batches agrees here (2 and 2): the loss would broadcast.
    CHECK(error_of([&] {
            pipe->train_step(torch::randn({4, 8}), torch::randn({3, 4}), mse);
          }) ==
          "stagewise::Pipe::train_step: the target has 3 rows but the input has 4; give one target "
          "row per input row");
    auto per_element = [](const torch::Tensor& out, const torch::Tensor& t) {
      return torch::mse_loss(out, t, torch::Reduction::None);
    };
    const auto e = error_of([&] {
      pipe->train_step(torch::randn({4, 8}), torch::randn({4, 4}), per_element);
    });
    CHECK(contains(
        e,
        "stagewise::train_step: loss_fn returned a tensor of shape [2, 4], not a scalar; reduce "
        "it to the mean over the micro-batch (e.g. torch::mse_loss(out, target) with its "
        "default Reduction::Mean, or loss.mean())"));
    CHECK(contains(e, "(stagewise: stage 0, micro-batch 0, forward)"));
    CHECK(error_of([&] {
            pipe->train_step(torch::randn({0, 8}), torch::randn({0, 4}), mse);
          }) ==
          "stagewise::Pipe::train_step: the batch is empty (the input has 0 rows); a step needs at "
          "least one row, so skip empty batches");
    CHECK(contains(error_of([&] {
                     pipe->train_step(torch::randn({4, 8}), torch::randn({}), mse);
                   }),
                   "the target is a scalar; give a tensor whose first dimension is the batch"));
    // Nothing ran: the pipe still trains.
    CHECK(pipe->train_step(torch::randn({4, 8}), torch::randn({4, 4}), mse).dim() == 0);
  }

  TEST_CASE("train_step checks every tensor of tuple inputs and targets") {
    struct SumImpl : torch::nn::Module {
      torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a * 2 + b * 3; }
    };
    torch::nn::Sequential seq;
    seq->push_back(std::make_shared<SumImpl>());
    seq->push_back(torch::nn::Linear(2, 2));
    auto pipe = sw::Pipe(seq, sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    auto pair_mse = [](const torch::Tensor& out, const torch::Tensor& t) {
      return torch::mse_loss(out, t);
    };
    CHECK(error_of([&] {
            pipe->train_step(sw::Batch({torch::rand({4, 2}), torch::rand({3, 2})}),
                             sw::Batch(torch::rand({4, 2})), pair_mse);
          }) ==
          "stagewise::Pipe::train_step: input tensor 1 has 3 rows but input tensor 0 has 4; every "
          "tensor of the input must have one row per example");
    CHECK(error_of([&] {
            pipe->train_step(sw::Batch({torch::rand({4, 2}), torch::rand({4, 2})}),
                             sw::Batch({torch::rand({4, 2}), torch::rand({2, 2})}), pair_mse);
          }) ==
          "stagewise::Pipe::train_step: target tensor 1 has 2 rows but the input has 4; give one "
          "target row per input row");
    CHECK(
        error_of([&] {
          pipe->train_step(sw::Batch({torch::rand({0, 2}), torch::rand({0, 2})}),
                           sw::Batch(torch::rand({0, 2})), pair_mse);
        }) ==
        "stagewise::Pipe::train_step: the batch is empty (input tensor 0 has 0 rows); a step needs "
        "at least one row, so skip empty batches");
    auto loss = pipe->train_step(sw::Batch({torch::rand({4, 2}), torch::rand({4, 2})}),
                                 sw::Batch(torch::rand({4, 2})), pair_mse);
    CHECK(loss.dim() == 0);
  }
}
