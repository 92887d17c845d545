#include "stagewise/pipe.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// Counts the nodes named like `name` reachable from `root`.
int count_nodes(const std::shared_ptr<torch::autograd::Node>& root, const std::string& name) {
  std::vector<torch::autograd::Node*> stack{root.get()};
  std::set<torch::autograd::Node*> seen;
  int count = 0;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (contains(node->name(), name)) ++count;
    for (const auto& e : node->next_edges()) stack.push_back(e.function.get());
  }
  return count;
}

// A layer running `fn` on every forward.
struct HookImpl : torch::nn::Module {
  explicit HookImpl(std::function<torch::Tensor(torch::Tensor)> f) : fn(std::move(f)) {}
  torch::Tensor forward(torch::Tensor x) { return fn(x); }
  std::function<torch::Tensor(torch::Tensor)> fn;
};
TORCH_MODULE(Hook);

struct ExpectedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Identity : torch::autograd::Function<Identity> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0]};
  }
};

torch::nn::Sequential linears(int n, int width = 4) {
  torch::nn::Sequential seq;
  for (int i = 0; i < n; ++i) seq->push_back(torch::nn::Linear(width, width));
  return seq;
}

}  // namespace

TEST_SUITE("pipe forward") {
  TEST_CASE("an indivisible batch (7 rows, chunks 4) and a small one (2 rows, chunks 4) run") {
    auto pipe = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(4));
    CHECK(pipe->forward(torch::rand({7, 4})).size(0) == 7);
    CHECK(pipe->forward(torch::rand({2, 4})).size(0) == 2);
  }

  TEST_CASE("chunks 2 hold 2 / 1 / 0 Checkpoint nodes for always / except_last / never") {
    const std::pair<sw::Checkpoint, int> cases[] = {
        {sw::Checkpoint::always, 2}, {sw::Checkpoint::except_last, 1}, {sw::Checkpoint::never, 0}};
    for (auto [mode, expected] : cases) {
      auto pipe = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(2).checkpoint(mode));
      auto y = pipe->forward(torch::rand({2, 4}, torch::requires_grad()));
      // one Checkpoint node per checkpointed cell: micro-batches x stages
      CHECK(count_nodes(y.grad_fn(), "CheckpointFunction") == expected * 2);
      CHECK(count_nodes(y.grad_fn(), "RecomputeFunction") == expected * 2);
    }
  }

  TEST_CASE("in eval mode neither Checkpoint nor Recompute is in the graph") {
    auto pipe = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(2).checkpoint("always"));
    pipe->eval();
    auto y = pipe->forward(torch::rand({2, 4}, torch::requires_grad()));
    CHECK(y.grad_fn());
    CHECK(count_nodes(y.grad_fn(), "CheckpointFunction") == 0);
    CHECK(count_nodes(y.grad_fn(), "RecomputeFunction") == 0);
  }

  TEST_CASE("under no-grad the output has no grad_fn") {
    auto pipe = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(2).checkpoint("always"));
    torch::NoGradGuard no_grad;
    CHECK_FALSE(pipe->forward(torch::rand({2, 4}, torch::requires_grad())).grad_fn());
  }

  TEST_CASE("a layer's exception reaches the caller unchanged and stops the pipeline at once") {
    std::atomic<int> slow_runs{0};
    torch::nn::Sequential seq(
        Hook([](torch::Tensor x) { return x; }), Hook([](torch::Tensor x) { return x; }),
        Hook([&](torch::Tensor x) {
          ++slow_runs;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          return x;
        }),
        Hook([](torch::Tensor) -> torch::Tensor { throw ExpectedError("layer 3 failed"); }));
    auto pipe = sw::Pipe(seq, sw::balance{1, 1, 1, 1}, sw::PipeOptions().chunks(3));
    CHECK_THROWS_WITH_AS(pipe->forward(torch::rand({3, 1})), "layer 3 failed", ExpectedError);
    CHECK(slow_runs == 2);
  }

  TEST_CASE("an error in the last of 3 stages with chunks 3 raises and does not hang") {
    torch::nn::Sequential seq(Hook([](torch::Tensor x) { return x; }), Hook([](torch::Tensor x) { return x; }),
                              Hook([](torch::Tensor) -> torch::Tensor { throw ExpectedError("last"); }));
    auto pipe = sw::Pipe(seq, sw::balance{1, 1, 1}, sw::PipeOptions().chunks(3));
    CHECK_THROWS_AS(pipe->forward(torch::rand({3, 1})), ExpectedError);
    CHECK_THROWS_AS(pipe->forward(torch::rand({3, 1})), ExpectedError);  // still usable
  }

  TEST_CASE("a pair of input tensors both get gradients") {
    struct SumImpl : torch::nn::Module {
      torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a * 2 + b * 3; }
    };
    torch::nn::Sequential seq;
    seq->push_back(std::make_shared<SumImpl>());
    seq->push_back(torch::nn::Functional(torch::relu));
    auto pipe = sw::Pipe(seq, sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    auto a = torch::rand({4, 2}, torch::requires_grad());
    auto b = torch::rand({4, 2}, torch::requires_grad());
    pipe->forward_batch(sw::Batch({a, b})).tensor().sum().backward();
    CHECK(a.grad().equal(torch::full({4, 2}, 2.0f)));
    CHECK(b.grad().equal(torch::full({4, 2}, 3.0f)));
  }

  TEST_CASE("a one-tuple input: the parameters and the input get gradients") {
    auto seq = linears(2, 1);
    auto pipe = sw::Pipe(seq, sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    auto x = torch::rand({2, 1}, torch::requires_grad());
    auto y = pipe->forward_batch(sw::Batch(std::vector<torch::Tensor>{x}));
    y[0].sum().backward();
    CHECK(x.grad().defined());
    for (auto& p : pipe->parameters()) CHECK(p.grad().defined());
  }

  TEST_CASE("transparency: 4 Linear layers split [2,2], chunks 4, equal the unpipelined model") {
    for (auto mode : {sw::Checkpoint::always, sw::Checkpoint::except_last, sw::Checkpoint::never}) {
      torch::manual_seed(0);
      auto seq = linears(4, 3);
      auto x = torch::randn({8, 3}, torch::requires_grad());
      // Unpipelined, on the same micro-batches (so the arithmetic is the same).
      std::vector<torch::Tensor> outs;
      for (auto& chunk : x.chunk(4)) outs.push_back(seq->forward(chunk));
      torch::cat(outs).pow(2).sum().backward();
      std::vector<torch::Tensor> expected;
      for (auto& p : seq->parameters()) expected.push_back(p.grad().clone());
      auto expected_x = x.grad().clone();
      seq->zero_grad();
      x.mutable_grad().reset();

      auto pipe = sw::Pipe(seq, sw::balance{2, 2}, sw::PipeOptions().chunks(4).checkpoint(mode));
      auto y = pipe->forward(x);
      CHECK(y.equal(torch::cat(outs)));
      y.pow(2).sum().backward();
      auto params = seq->parameters();
      for (std::size_t k = 0; k < params.size(); ++k) CHECK(params[k].grad().equal(expected[k]));
      CHECK(x.grad().equal(expected_x));

      // And the whole-batch model, up to float rounding.
      seq->zero_grad();
      auto whole = seq->forward(x.detach());
      CHECK(torch::allclose(y, whole, 1e-6, 1e-6));
    }
  }

  TEST_CASE("a custom autograd identity inside a stage, mode always: output equals input") {
    torch::nn::Sequential seq(Hook([](torch::Tensor x) { return Identity::apply(x); }));
    auto pipe = sw::Pipe(seq, sw::balance{1}, sw::PipeOptions().chunks(2).checkpoint("always"));
    auto x = torch::rand({4, 2}, torch::requires_grad());
    auto y = pipe->forward(x);
    CHECK(y.equal(x));
    y.sum().backward();
    CHECK(x.grad().equal(torch::ones({4, 2})));
  }

  TEST_CASE("100 dropout layers on 2 stages, chunks 10, mode always: recompute replays the masks") {
    torch::nn::Sequential seq;
    for (int i = 0; i < 100; ++i) seq->push_back(torch::nn::Dropout(0.001));
    auto pipe = sw::Pipe(seq, sw::balance{50, 50}, sw::PipeOptions().chunks(10).checkpoint("always"));
    auto x = torch::rand({10, 10}, torch::requires_grad());
    auto y = pipe->forward(x);
    y.norm().backward();
    CHECK(y.to(torch::kBool).equal(x.grad().to(torch::kBool)));
    CHECK(y.eq(0).sum().item<int64_t>() > 0);  // some elements were dropped
  }

  TEST_CASE("the forward runs in lockstep by clock cycle even when the second stage is slow") {
    std::mutex mutex;
    std::vector<std::pair<int, int>> timeline;
    int calls[2] = {0, 0};
    auto logger = [&](int stage, bool slow) {
      return Hook([&, stage, slow](torch::Tensor x) {
        if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::lock_guard<std::mutex> lock(mutex);
        timeline.emplace_back(calls[stage]++, stage);
        return x;
      });
    };
    auto pipe = sw::Pipe(sw::stages(logger(0, false), logger(1, true)), sw::PipeOptions().chunks(3));
    pipe->forward(torch::rand({3, 1}));
    CHECK(timeline == std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {0, 1}, {2, 0}, {1, 1}, {2, 1}});
  }

  TEST_CASE("workers inherit the caller's grad mode") {
    std::vector<bool> modes;
    std::mutex mutex;
    auto pipe = sw::Pipe(sw::stages(Hook([&](torch::Tensor x) {
                           std::lock_guard<std::mutex> lock(mutex);
                           modes.push_back(torch::GradMode::is_enabled());
                           return x * 1;
                         })),
                         sw::PipeOptions().chunks(2).checkpoint("never"));
    pipe->forward(torch::rand({2, 1}));
    {
      torch::NoGradGuard no_grad;
      pipe->forward(torch::rand({2, 1}));
    }
    CHECK(modes == std::vector<bool>{true, true, false, false});
  }

  TEST_CASE("several pipes live at once and each runs on its own workers") {
    auto a = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    auto b = sw::Pipe(linears(2), sw::balance{1, 1}, sw::PipeOptions().chunks(2));
    std::thread other([&] {
      for (int i = 0; i < 20; ++i) b->forward(torch::rand({4, 4})).sum().backward();
    });
    for (int i = 0; i < 20; ++i) a->forward(torch::rand({4, 4})).sum().backward();
    other.join();
    CHECK(a->parameters()[0].grad().defined());
    CHECK(b->parameters()[0].grad().defined());
  }
}
