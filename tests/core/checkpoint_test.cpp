#include "stagewise/core/checkpoint.hpp"
#include "stagewise/core/dependency.hpp"

#include <torch/torch.h>

#include "tests/support/autocast.hpp"

#include <doctest/doctest.h>

#include <string>
#include <tuple>
#include <vector>

namespace sw = stagewise;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

std::vector<std::string>& timeline() {
  static std::vector<std::string> t;
  return t;
}

// Identity that logs its forward and backward under a name.
struct Log : torch::autograd::Function<Log> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, std::string name) {
    ctx->saved_data["name"] = name;
    timeline().push_back(name + ":forward");
    return x.detach();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    timeline().push_back(ctx->saved_data["name"].toStringRef() + ":backward");
    return {g[0], torch::Tensor()};
  }
};

}  // namespace

TEST_SUITE("checkpoint") {
  TEST_CASE("two checkpoints joined by fork/join recompute each just before its backward") {
    timeline().clear();
    auto a = torch::rand({1}, torch::requires_grad());
    auto b = torch::rand({1}, torch::requires_grad());
    auto a1 = sw::checkpoint([](const torch::Tensor& x) { return Log::apply(x, "a"); }, a);
    auto [a2, phony] = sw::fork(a1);
    auto b1 = sw::join(b, phony);
    auto b2 = sw::checkpoint([](const torch::Tensor& x) { return Log::apply(x, "b"); }, b1);
    torch::cat({a2, b2}).sum().backward();
    CHECK(timeline() == std::vector<std::string>{"a:forward", "b:forward", "b:forward",
                                                 "b:backward", "a:forward", "a:backward"});
    CHECK(a.grad().item<float>() == 1.0f);
    CHECK(b.grad().item<float>() == 1.0f);
  }

  TEST_CASE("an input that does not require grad still gives the output and parameters grads") {
    torch::nn::Linear linear(3, 2);
    auto x = torch::rand({4, 3});
    auto y = sw::checkpoint([&](const torch::Tensor& in) { return linear->forward(in); }, x);
    CHECK(y.requires_grad());
    y.sum().backward();
    REQUIRE(linear->weight.grad().defined());
    CHECK(linear->weight.grad().equal(x.sum(0).expand({2, 3})));
    CHECK_FALSE(x.grad().defined());
  }

  TEST_CASE("gradients equal those computed without checkpointing") {
    torch::manual_seed(1);
    torch::nn::Sequential block(torch::nn::Linear(5, 7), torch::nn::Tanh(),
                                torch::nn::Linear(7, 3));
    auto x = torch::randn({6, 5}, torch::requires_grad());
    block->forward(x).pow(2).sum().backward();
    auto gx = x.grad().clone();
    auto gw = block[0]->parameters()[0].grad().clone();
    x.mutable_grad().reset();
    block->zero_grad();
    sw::checkpoint([&](const torch::Tensor& in) { return block->forward(in); }, x)
        .pow(2)
        .sum()
        .backward();
    CHECK(x.grad().equal(gx));
    CHECK(block[0]->parameters()[0].grad().equal(gw));
  }

  TEST_CASE("dropout under checkpoint gives the same input gradient as without") {
    torch::nn::Dropout dropout(0.5);
    auto x = torch::rand({64, 16}, torch::requires_grad());
    torch::manual_seed(7);
    dropout->forward(x).sum().backward();
    auto expected = x.grad().clone();
    x.mutable_grad().reset();
    torch::manual_seed(7);
    auto y = sw::checkpoint([&](const torch::Tensor& in) { return dropout->forward(in); }, x);
    (void)torch::rand({1000});  // draws between forward and recompute must not matter
    y.sum().backward();
    CHECK(x.grad().equal(expected));
  }

  TEST_CASE("is_checkpointing and is_recomputing tell the two runs apart") {
    std::vector<std::pair<bool, bool>> seen;
    auto probe = [&](const torch::Tensor& in) {
      seen.emplace_back(sw::is_checkpointing(), sw::is_recomputing());
      return in * 2;
    };
    CHECK_FALSE(sw::is_checkpointing());
    CHECK_FALSE(sw::is_recomputing());
    auto x = torch::rand({2}, torch::requires_grad());
    auto y = sw::checkpoint(probe, x);
    y.sum().backward();
    (void)probe(x);
    CHECK(seen == std::vector<std::pair<bool, bool>>{{true, false}, {false, true}, {false, false}});
  }

  TEST_CASE("non-tensor and non-float values pass through") {
    auto x = torch::rand({3}, torch::requires_grad());
    auto ids = torch::tensor({0, 2, 1});
    auto [y, count, picked] = sw::checkpoint(
        [](const torch::Tensor& in, const torch::Tensor& index, double scale, int64_t n) {
          return std::make_tuple(in.index_select(0, index) * scale, n + 1, index + 1);
        },
        x, ids, 3.0, int64_t{41});
    CHECK(count == 42);
    CHECK(picked.equal(torch::tensor({1, 3, 2})));
    CHECK_FALSE(picked.requires_grad());
    y.sum().backward();
    CHECK(x.grad().equal(torch::full({3}, 3.0f)));
  }

  TEST_CASE("a vector of tensors in and out") {
    auto a = torch::rand({2}, torch::requires_grad());
    auto b = torch::rand({2}, torch::requires_grad());
    auto out = sw::checkpoint(
        [](const std::vector<torch::Tensor>& v) {
          return std::vector<torch::Tensor>{v[0] * v[1], v[0]};
        },
        std::vector<torch::Tensor>{a, b});
    REQUIRE(out.size() == 2);
    (out[0].sum() + out[1].sum()).backward();
    CHECK(a.grad().equal(b.detach() + 1));
    CHECK(b.grad().equal(a.detach()));
  }

  TEST_CASE("a custom identity function inside a checkpoint returns its input") {
    auto x = torch::rand({4}, torch::requires_grad());
    auto y = sw::checkpoint([](const torch::Tensor& in) { return Log::apply(in, "id"); }, x);
    CHECK(y.equal(x));
    y.sum().backward();
    CHECK(x.grad().equal(torch::ones({4})));
  }

  TEST_CASE("under no-grad the function simply runs and records nothing") {
    auto x = torch::rand({2}, torch::requires_grad());
    torch::NoGradGuard no_grad;
    bool checkpointing = true;
    auto y = sw::checkpoint(
        [&](const torch::Tensor& in) {
          checkpointing = sw::is_checkpointing();
          return in + 1;
        },
        x);
    CHECK_FALSE(y.requires_grad());
    CHECK_FALSE(checkpointing);
  }

  TEST_CASE("the graph and the saved input are freed after backward") {
    auto x = torch::rand({256}, torch::requires_grad());
    std::weak_ptr<torch::autograd::Node> node;
    {
      auto y = sw::checkpoint([](const torch::Tensor& in) { return in.sin(); }, x);
      node = y.grad_fn();
      CHECK(x.use_count() > 1);
      y.sum().backward();
    }
    CHECK(node.expired());
    CHECK(x.use_count() == 1);
  }

  TEST_CASE(
      "under CPU bf16 autocast the gradients equal those without checkpointing, with backward "
      "inside or after the autocast region") {
    for (bool inside : {true, false}) {
      CAPTURE(inside);
      torch::manual_seed(5);
      torch::nn::Linear a(8, 8);  // applied twice: one cast of its weight, with or without
      torch::nn::Linear b(8, 4);  // checkpointing
      auto ra = std::dynamic_pointer_cast<torch::nn::LinearImpl>(a->clone());
      auto rb = std::dynamic_pointer_cast<torch::nn::LinearImpl>(b->clone());
      auto x = torch::randn({4, 8}, torch::requires_grad());
      auto rx = x.detach().clone().requires_grad_();
      auto f = [&](const torch::Tensor& v) {
        return b->forward(torch::relu(a->forward(a->forward(v))));
      };
      torch::Tensor y, z, ry, rz;
      {
        sw::testing::CpuAutocastRegion region;
        y = sw::checkpoint(f, x);
        // A forward with grad after the checkpoint's no-grad run, in the same region: it must not
        // reuse casts of b's parameters that lack autograd history.
        z = b->forward(x);
        ry = rb->forward(torch::relu(ra->forward(ra->forward(rx))));
        rz = rb->forward(rx);
        if (inside) {
          z.to(torch::kFloat).sum().backward();
          y.to(torch::kFloat).sum().backward();
        }
      }
      if (!inside) {
        z.to(torch::kFloat).sum().backward();
        y.to(torch::kFloat).sum().backward();
      }
      rz.to(torch::kFloat).sum().backward();
      ry.to(torch::kFloat).sum().backward();
      CHECK(y.dtype() == torch::kBFloat16);
      CHECK(y.equal(ry));
      for (auto [p, q] :
           {std::pair{a->weight, ra->weight}, std::pair{a->bias, ra->bias},
            std::pair{b->weight, rb->weight}, std::pair{b->bias, rb->bias}, std::pair{x, rx}}) {
        REQUIRE(p.grad().defined());
        CHECK(p.grad().dtype() == torch::kFloat);
        CHECK(p.grad().equal(q.grad()));
      }
      CHECK_FALSE(sw::testing::cpu_autocast_enabled());
    }
  }
}
