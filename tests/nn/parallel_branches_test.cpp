#include "stagewise/nn/parallel_branches.hpp"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace sw = stagewise;

using stagewise::testing::error_of;
using stagewise::testing::contains;

namespace {

torch::nn::Sequential expert(int64_t width) {
  return torch::nn::Sequential(torch::nn::Linear(8, width), torch::nn::ReLU(),
                               torch::nn::Linear(width, 8));
}

struct TwiceImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x * 2; }
};
TORCH_MODULE(Twice);

}  // namespace

static_assert(sw::branch_module<torch::nn::Linear>);
static_assert(sw::branch_module<torch::nn::Sequential>);
static_assert(sw::branch_module<Twice>);
static_assert(sw::branch_module<std::shared_ptr<TwiceImpl>>);
static_assert(!sw::branch_module<int>);
static_assert(!sw::branch_module<TwiceImpl>);  // a module by value, not a holder or pointer
static_assert(!sw::branch_module<sw::ParallelBranches>);  // forward returns a list

TEST_SUITE("ParallelBranches module") {
  TEST_CASE("the branches' parameters are registered, so an optimizer sees and updates them") {
    sw::ParallelBranches experts(expert(16), expert(4), Twice());
    CHECK(experts->size() == 3);
    CHECK(experts->children().size() == 3);
    std::set<std::string> names;
    for (const auto& item : experts->named_parameters()) names.insert(item.key());
    CHECK(names == std::set<std::string>{"0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias",
                                         "1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"});

    std::vector<torch::Tensor> before;
    for (const auto& p : experts->parameters()) before.push_back(p.detach().clone());
    torch::optim::SGD sgd(experts->parameters(), torch::optim::SGDOptions(0.1));
    auto outs = experts->forward(torch::randn({4, 8}));
    (outs[0].sum() + outs[1].sum()).backward();
    sgd.step();
    const auto after = experts->parameters();
    REQUIRE(after.size() == before.size());
    for (std::size_t i = 0; i < after.size(); ++i) CHECK_FALSE(after[i].equal(before[i]));
  }

  TEST_CASE("forward equals running the branch modules one after another, gradients too") {
    torch::manual_seed(0);
    auto a = expert(16);
    auto b = expert(32);
    sw::ParallelBranches experts(a, b);
    auto x = torch::randn({5, 8}, torch::requires_grad());
    auto params = experts->parameters();

    auto ya = a->forward(x);
    auto yb = b->forward(x);
    (ya.pow(2).sum() + yb.sum()).backward();
    std::vector<torch::Tensor> expected{x.grad().clone()};
    for (auto& p : params) expected.push_back(p.grad().clone());
    x.mutable_grad().reset();
    for (auto& p : params) p.mutable_grad().reset();

    auto outs = experts->forward(x);
    REQUIRE(outs.size() == 2);
    CHECK(outs[0].equal(ya));
    CHECK(outs[1].equal(yb));
    (outs[0].pow(2).sum() + outs[1].sum()).backward();
    CHECK(x.grad().equal(expected[0]));
    for (std::size_t i = 0; i < params.size(); ++i) CHECK(params[i].grad().equal(expected[i + 1]));
  }

  TEST_CASE("forward_each gives branch i input i; a wrong count is an error naming the fix") {
    sw::ParallelBranches experts(expert(4), Twice());
    auto x0 = torch::randn({3, 8});
    auto x1 = torch::randn({7, 8});
    auto outs = experts->forward_each({x0, x1});
    CHECK(outs[0].sizes() == torch::IntArrayRef{3, 8});
    CHECK(outs[1].equal(x1 * 2));
    CHECK(contains(error_of([&] { experts->forward_each({x0}); }),
                   "forward_each got 1 inputs for 2 branches. Pass one input per branch"));
  }

  TEST_CASE("forward_reduced combines with the given reduction; without one it names the fix") {
    auto options = sw::ParallelBranchesOptions().reduction(
        [](const std::vector<torch::Tensor>& outs) { return torch::cat(outs, 1); });
    sw::ParallelBranches block(options, Twice(), Twice(), Twice());
    auto x = torch::randn({2, 8});
    auto y = block->forward_reduced(x);
    CHECK(y.sizes() == torch::IntArrayRef{2, 24});
    CHECK(y.equal(torch::cat({x * 2, x * 2, x * 2}, 1)));

    sw::ParallelBranches plain{Twice()};
    CHECK(contains(error_of([&] { plain->forward_reduced(x); }),
                   "forward_reduced needs a reduction. Set one with "
                   "ParallelBranchesOptions().reduction(...)"));
  }

  TEST_CASE("branches can be added by name, and train()/eval() reach them") {
    sw::ParallelBranches block;
    CHECK(block->size() == 0);
    CHECK(block->forward(torch::ones({1})).empty());
    block->push_back("dropout", torch::nn::Dropout(0.5));
    block->push_back(Twice());
    CHECK(block->named_children().contains("dropout"));
    CHECK(block->named_children().contains("1"));
    block->eval();
    for (const auto& child : block->children()) CHECK_FALSE(child->is_training());
    auto x = torch::ones({100});
    CHECK(block->forward(x)[0].equal(x));  // dropout is the identity in eval mode
    block->train();
    for (const auto& child : block->children()) CHECK(child->is_training());
  }

  TEST_CASE("a custom pool is used and the module works under no-grad") {
    auto pool = std::make_shared<sw::ThreadPool>(3);
    sw::ParallelBranches experts(sw::ParallelBranchesOptions().pool(pool), expert(4), expert(4));
    CHECK(experts->options.pool() == pool);
    torch::NoGradGuard no_grad;
    auto outs = experts->forward(torch::randn({2, 8}));
    CHECK_FALSE(outs[0].requires_grad());
    CHECK_FALSE(outs[1].grad_fn());
  }
}
