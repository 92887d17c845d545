#include "stagewise/core/dependency.hpp"

#include <torch/autograd.h>

#include <doctest/doctest.h>

#include <memory>
#include <thread>
#include <tuple>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Identity whose backward appends `id` to a log, to observe backward order.
struct Log : torch::autograd::Function<Log> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t id,
                               std::vector<int>* log) {
    ctx->saved_data["id"] = id;
    ctx->saved_data["log"] = reinterpret_cast<int64_t>(log);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto* log = reinterpret_cast<std::vector<int>*>(ctx->saved_data["log"].toInt());
    log->push_back(static_cast<int>(ctx->saved_data["id"].toInt()));
    return {g[0], torch::Tensor(), torch::Tensor()};
  }
};

// Identity that saves a tensor in its context, to see the context released.
struct Holds : torch::autograd::Function<Holds> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor payload) {
    ctx->save_for_backward({payload});
    return x.clone();
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {g[0], torch::Tensor()};
  }
};

}  // namespace

TEST_SUITE("fork and join") {
  // The CPU engine runs ready nodes in decreasing sequence number, and sequence numbers count per
  // thread. Branch 2 is recorded on a fresh thread, so its numbers are lower than branch 1's and,
  // left alone, autograd runs branch 1's backward first. Only the fork/join edge can reverse that.
  std::vector<int> backward_order(bool with_dependency) {
    std::vector<int> log;
    auto a = torch::ones({1}, torch::requires_grad());
    auto b = torch::ones({1}, torch::requires_grad());
    for (int i = 0; i < 8; ++i) (void)(a * 1);  // main-thread sequence numbers are above 8
    auto a1 = Log::apply(a, 1, &log);
    torch::Tensor phony;
    if (with_dependency) std::tie(a1, phony) = sw::fork(a1);
    torch::Tensor b2;
    std::thread([&] {
      auto b1 = with_dependency ? sw::join(b, phony) : b;
      b2 = Log::apply(b1, 2, &log);
    }).join();
    (a1 + b2).sum().backward();
    CHECK(a.grad().item<float>() == 1.0f);
    CHECK(b.grad().item<float>() == 1.0f);
    return log;
  }

  TEST_CASE("without a fork/join edge the engine runs branch 1 first: [1, 2]") {
    CHECK(backward_order(false) == std::vector<int>{1, 2});
  }

  TEST_CASE("backward order across a fork/join pair is enforced: [2, 1]") {
    CHECK(backward_order(true) == std::vector<int>{2, 1});
  }

  TEST_CASE("fork creates a node and a phony that requires grad when grad is enabled") {
    auto x = torch::rand({2}, torch::requires_grad());
    auto [y, p] = sw::fork(x);
    CHECK(y.grad_fn());
    CHECK(p.requires_grad());
    CHECK(p.numel() == 0);
    CHECK(y.equal(x));
  }

  TEST_CASE("fork and join record no nodes under no-grad") {
    auto x = torch::rand({2}, torch::requires_grad());
    torch::NoGradGuard no_grad;
    auto [y, p] = sw::fork(x);
    CHECK_FALSE(y.grad_fn());
    CHECK_FALSE(p.requires_grad());
    auto z = sw::join(y, sw::phony(torch::kCPU, true));
    CHECK_FALSE(z.grad_fn());
  }

  TEST_CASE("join adds requires_grad only if the fork side had it") {
    auto x = torch::rand({2, 1});
    auto halves = x.chunk(2);
    auto [a, p] = sw::fork(halves[0]);
    CHECK_FALSE(a.requires_grad());
    CHECK_FALSE(p.requires_grad());
    CHECK_FALSE(sw::join(halves[1], p).requires_grad());

    auto y = torch::rand({2, 1});
    auto parts = y.chunk(2);
    auto first = parts[0].detach().requires_grad_();
    auto [a2, p2] = sw::fork(first);
    CHECK(a2.requires_grad());
    CHECK(p2.requires_grad());
    CHECK_FALSE(parts[1].requires_grad());
    auto b2 = sw::join(parts[1], p2);
    CHECK(b2.requires_grad());
    CHECK(b2.equal(parts[1]));
  }

  TEST_CASE("nothing leaks: the graph and its saved state are freed after backward") {
    auto payload = torch::rand({1024});
    std::weak_ptr<torch::autograd::Node> fork_node;
    std::weak_ptr<torch::autograd::Node> join_node;
    {
      auto x = torch::rand({1}, torch::requires_grad());
      auto y = Holds::apply(x, payload);
      auto [y2, p] = sw::fork(y);
      fork_node = y2.grad_fn();
      auto z = sw::join(y2, p);
      join_node = z.grad_fn();
      CHECK(payload.use_count() > 1);  // held by Holds' context
      z.sum().backward();
      CHECK(x.grad().item<float>() == 1.0f);
    }
    CHECK(fork_node.expired());
    CHECK(join_node.expired());
    CHECK(payload.use_count() == 1);
  }
}
