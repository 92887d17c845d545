// Experts that get no tokens, run by ParallelBranches: they cost nothing (no graph, no backward)
// and break nothing (right output shapes, no gradient, a fused step skips them).
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <vector>

namespace sw = stagewise;

namespace {

constexpr int64_t kDim = 6;

torch::nn::Sequential expert() {
  return torch::nn::Sequential(torch::nn::Linear(kDim, 10), torch::nn::GELU(),
                               torch::nn::Linear(10, kDim));
}

// Three experts; `rows[e]` tokens go to expert e (0 = none).
struct Moe {
  Moe() {
    torch::manual_seed(11);
    for (int e = 0; e < 3; ++e) {
      list.push_back(expert());
      experts->push_back(list.back());
    }
  }
  // The routed tokens of x, expert by expert, and the combined output.
  torch::Tensor forward(const torch::Tensor& x, const std::vector<int64_t>& rows, bool parallel) {
    std::vector<torch::Tensor> tokens;
    int64_t start = 0;
    for (auto r : rows) {
      tokens.push_back(x.narrow(0, start, r));
      start += r;
    }
    std::vector<torch::Tensor> outs;
    if (parallel) {
      outs = experts->forward_each(tokens);
    } else {
      for (std::size_t e = 0; e < list.size(); ++e) {  // the usual loop: skip empty experts
        outs.push_back(tokens[e].size(0) == 0 ? torch::zeros({0, kDim})
                                              : list[e]->forward(tokens[e]));
      }
    }
    last_outs = outs;
    return torch::cat(outs, 0);
  }
  sw::ParallelBranches experts;
  std::vector<torch::nn::Sequential> list;
  std::vector<torch::Tensor> last_outs;
};

}  // namespace

TEST_SUITE("ParallelBranches: an expert with zero tokens") {
  TEST_CASE("returns zero rows, records no graph and gets no gradient; the rest is bit-equal") {
    Moe par, seq;
    auto x = torch::randn({7, kDim}, torch::requires_grad());
    auto xs = x.detach().clone().requires_grad_(true);
    const std::vector<int64_t> rows{4, 0, 3};
    auto w = torch::randn({7, kDim});
    (par.forward(x, rows, true) * w).sum().backward();
    (seq.forward(xs, rows, false) * w).sum().backward();
    CHECK(par.last_outs[1].sizes() == torch::IntArrayRef{0, kDim});
    CHECK_FALSE(par.last_outs[1].requires_grad());
    CHECK(par.last_outs[0].requires_grad());
    for (auto& p : par.list[1]->parameters()) CHECK_FALSE(p.grad().defined());
    auto pp = par.experts->parameters();
    auto sp = seq.experts->parameters();
    REQUIRE(pp.size() == sp.size());
    for (std::size_t i = 0; i < pp.size(); ++i) {
      CHECK(pp[i].grad().defined() == sp[i].grad().defined());
      if (pp[i].grad().defined()) CHECK(pp[i].grad().equal(sp[i].grad()));
    }
    CHECK(x.grad().equal(xs.grad()));
  }

  TEST_CASE("the empty expert runs under no-grad and its backward never runs") {
    int forwards_with_grad = 0;
    int forwards_without_grad = 0;
    int backwards = 0;
    auto probe = [&](const torch::Tensor& t) {
      (torch::GradMode::is_enabled() ? forwards_with_grad : forwards_without_grad) += 1;
      auto y = t * 2;
      if (y.requires_grad()) {
        y.register_hook([&](const torch::Tensor& g) {
          ++backwards;
          return g;
        });
      }
      return y;
    };
    auto x = torch::randn({3, 2}, torch::requires_grad());
    auto outs = sw::parallel_branches({probe, probe}, {x, x.narrow(0, 0, 0)});
    CHECK(forwards_with_grad == 1);
    CHECK(forwards_without_grad == 1);
    torch::cat(outs, 0).sum().backward();
    CHECK(backwards == 1);
    CHECK(x.grad().equal(torch::full({3, 2}, 2.0)));
  }

  TEST_CASE("when every expert is empty nothing is recorded and backward elsewhere still works") {
    Moe moe;
    auto x = torch::randn({0, kDim}, torch::requires_grad());
    auto y = moe.forward(x, {0, 0, 0}, true);
    CHECK(y.sizes() == torch::IntArrayRef{0, kDim});
    CHECK_FALSE(y.requires_grad());
    auto z = torch::randn({2}, torch::requires_grad());
    (z.sum() + y.sum()).backward();
    CHECK(z.grad().equal(torch::ones({2})));
    for (auto& p : moe.experts->parameters()) CHECK_FALSE(p.grad().defined());
  }

  TEST_CASE("a fused Adam step skips the empty expert and is bit-identical to Adam, 10 steps") {
    Moe fused_moe, plain_moe;
    sw::optim::FusedStep fused(fused_moe.experts->named_parameters(),
                               torch::optim::AdamOptions(1e-2));
    torch::optim::Adam plain(plain_moe.experts->parameters(), torch::optim::AdamOptions(1e-2));
    torch::manual_seed(2);
    for (int step = 0; step < 10; ++step) {
      const int64_t empty = step % 3;  // each expert goes without tokens now and then
      std::vector<int64_t> rows{3, 3, 3};
      rows[empty] = 0;
      auto x = torch::randn({6, kDim});
      auto w = torch::randn({6, kDim});
      (fused_moe.forward(x, rows, true) * w).sum().backward();
      fused.finish_step();
      (plain_moe.forward(x, rows, false) * w).sum().backward();
      plain.step();
      for (auto& p : plain_moe.experts->parameters()) p.mutable_grad().reset();
    }
    auto a = fused_moe.experts->parameters();
    auto b = plain_moe.experts->parameters();
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i].equal(b[i]));
  }
}
