// Errors say where: an exception from a stage keeps its type and text and records the stage, the
// micro-batch and the phase; a c10::Error also shows them in what(), after its own message.
#include "stagewise/pipe.hpp"
#include "stagewise/schedule/zero_bubble.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

namespace sw = stagewise;

namespace {

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

struct StageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Identity whose backward throws StageError("backward failed").
struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw StageError("backward failed");
  }
};

// What a call threw: its context as error_context gives it, the text of what(), and for a
// c10::Error its message without context.
struct Caught {
  std::optional<sw::ErrorContext> where;
  std::string what;
  std::string msg;
  bool c10 = false;
  bool stage_error = false;
};

Caught catch_from(const std::function<void()>& f) {
  Caught c;
  try {
    f();
  } catch (const c10::Error& e) {
    c.where = sw::error_context(std::current_exception());
    c.what = e.what_without_backtrace();
    c.msg = e.msg();
    c.c10 = true;
  } catch (const StageError& e) {
    c.where = sw::error_context(std::current_exception());
    c.what = e.what();
    c.stage_error = true;
  }
  return c;
}

void check_where(const Caught& c, int stage, int micro, sw::Phase phase) {
  REQUIRE(c.where.has_value());
  CHECK(c.where->stage == stage);
  CHECK(c.where->micro_batch == micro);
  CHECK(c.where->phase == phase);
}

// Fails (TORCH_CHECK, a c10::Error) on the one-row micro-batch.
const auto fails_on_one_row = [](const torch::Tensor& x) {
  TORCH_CHECK(x.size(0) != 1, "this stage refuses one-row batches");
  return x;
};

}  // namespace

TEST_SUITE("errors say where") {
  TEST_CASE("a c10::Error in forward() keeps its message and gains stage, micro-batch and phase") {
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails_on_one_row),
                         sw::PipeOptions().chunks(3));
    // 5 rows in 3 chunks: 2, 2, 1; the one-row micro-batch 2 fails in stage 1.
    auto c = catch_from([&] { pipe->forward(torch::rand({5, 2})); });
    REQUIRE(c.c10);
    CHECK(c.msg == "this stage refuses one-row batches");
    CHECK(c.what ==
          "this stage refuses one-row batches (stagewise: stage 1, micro-batch 2, forward)");
    check_where(c, 1, 2, sw::Phase::forward);
  }

  TEST_CASE(
      "a non-c10 exception in train_step keeps its type and text; the context is kept aside") {
    auto fails = [](const torch::Tensor& x) -> torch::Tensor {
      if (x.size(0) == 1) throw StageError("forward failed");
      return x;
    };
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails, torch::nn::Linear(2, 2)),
                         sw::PipeOptions().chunks(3));
    auto c = catch_from([&] { pipe->train_step(torch::rand({5, 2}), torch::rand({5, 2}), mse); });
    REQUIRE(c.stage_error);
    CHECK(c.what == "forward failed");
    check_where(c, 1, 2, sw::Phase::forward);
    CHECK(sw::error_context(std::exception_ptr()) == std::nullopt);
    CHECK(sw::error_context(std::make_exception_ptr(StageError("elsewhere"))) == std::nullopt);
  }

  TEST_CASE("train_step names the backward, the recompute and zero-bubble's input-gradient pass") {
    auto failing = [](const torch::Tensor& x) { return FailingBackward::apply(x); };
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), failing, torch::nn::Linear(2, 2)),
                         sw::PipeOptions().chunks(2).checkpoint("never"));
    // GPipe back-propagates micro-batch 1 first.
    auto c = catch_from([&] { pipe->train_step(torch::rand({4, 2}), torch::rand({4, 2}), mse); });
    REQUIRE(c.stage_error);
    CHECK(c.what == "backward failed");
    check_where(c, 1, 1, sw::Phase::backward);

    c = catch_from([&] {
      pipe->train_step(torch::rand({4, 2}), torch::rand({4, 2}), mse,
                       sw::schedule::zero_bubble_h1{});
    });
    REQUIRE(c.stage_error);
    check_where(c, 1, 0, sw::Phase::input_grad);

    auto fails_recompute = [](const torch::Tensor& x) {
      TORCH_CHECK(!sw::is_recomputing(), "recompute refused");
      return x * 2;
    };
    auto pipe2 = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails_recompute),
                          sw::PipeOptions().chunks(2).checkpoint("always"));
    c = catch_from([&] { pipe2->train_step(torch::rand({4, 2}), torch::rand({4, 2}), mse); });
    REQUIRE(c.c10);
    CHECK(c.msg == "recompute refused");
    CHECK(c.what == "recompute refused (stagewise: stage 1, micro-batch 1, recompute)");
    check_where(c, 1, 1, sw::Phase::recompute);
  }

  TEST_CASE(
      "forward()'s recompute and checkpointed backward say where, from the caller's backward") {
    auto fails_recompute = [](const torch::Tensor& x) {
      TORCH_CHECK(!sw::is_recomputing(), "recompute refused");
      return x * 2;
    };
    auto pipe = sw::Pipe(sw::stages(torch::nn::Linear(2, 2), fails_recompute),
                         sw::PipeOptions().chunks(2).checkpoint("always"));
    auto y = pipe->forward(torch::rand({4, 2}));
    // Backward visits micro-batch 1 first.
    auto c = catch_from([&] { y.sum().backward(); });
    REQUIRE(c.c10);
    CHECK(c.msg == "recompute refused");
    check_where(c, 1, 1, sw::Phase::recompute);

    auto failing = [](const torch::Tensor& x) { return FailingBackward::apply(x); };
    auto pipe2 = sw::Pipe(sw::stages(failing, torch::nn::Linear(2, 2)),
                          sw::PipeOptions().chunks(2).checkpoint("always"));
    auto y2 = pipe2->forward(torch::rand({4, 2}, torch::requires_grad()));
    c = catch_from([&] { y2.sum().backward(); });
    REQUIRE(c.stage_error);
    CHECK(c.what == "backward failed");
    check_where(c, 0, 1, sw::Phase::backward);

    // Without checkpointing a cell's backward is plain autograd inside the caller's backward, with
    // no stagewise code around it: the exception comes through, without a context.
    auto pipe3 = sw::Pipe(sw::stages(failing, torch::nn::Linear(2, 2)),
                          sw::PipeOptions().chunks(2).checkpoint("never"));
    auto y3 = pipe3->forward(torch::rand({4, 2}, torch::requires_grad()));
    c = catch_from([&] { y3.sum().backward(); });
    REQUIRE(c.stage_error);
    CHECK(c.what == "backward failed");
    CHECK(c.where == std::nullopt);
  }
}
