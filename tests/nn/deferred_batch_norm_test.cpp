#include "stagewise/nn/deferred_batch_norm.hpp"
#include "stagewise/core/checkpoint_state.hpp"
#include "stagewise/nn/convert_deferred_batch_norm.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <memory>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// Within 1e-6, relative for large values (a float near 100 is only good to about 1e-5).
bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.allclose(b, /*rtol=*/1e-6, /*atol=*/1e-6);
}

// A BatchNorm2d with non-trivial affine parameters and running statistics.
torch::nn::BatchNorm2d make_bn(torch::nn::BatchNormOptions options) {
  torch::nn::BatchNorm2d bn(options);
  torch::NoGradGuard no_grad;
  bn->weight.uniform_(0.5, 1.5);
  bn->bias.uniform_(-0.5, 0.5);
  bn->running_mean.uniform_(-1, 1);
  bn->running_var.uniform_(0.5, 2);
  return bn;
}

// A plain batch norm with the same state as `bn`, not sharing it.
torch::nn::BatchNorm2d copy_of(const torch::nn::BatchNorm2d& bn) {
  return torch::nn::BatchNorm2d(std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(bn->clone()));
}

struct HiddenImpl : torch::nn::Module {
  HiddenImpl() : bn(register_module("bn", torch::nn::BatchNorm1d(4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return bn->forward(x); }
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(Hidden);

}  // namespace

TEST_SUITE("deferred batch norm") {
  TEST_CASE(
      "running statistics equal plain batch norm over the whole batch, momentum and average") {
    for (const bool cumulative : {false, true}) {
      CAPTURE(cumulative);
      torch::manual_seed(1);
      auto options = torch::nn::BatchNormOptions(3).momentum(0.3);
      if (cumulative) options.momentum(c10::nullopt);
      auto bn = make_bn(options);
      auto plain = copy_of(bn);
      sw::DeferredBatchNorm deferred(*bn, /*chunks=*/4);
      for (int step = 0; step < 3; ++step) {
        // Shifted and scaled inputs (odd steps): a sum-of-squares variance would lose digits.
        auto x =
            step % 2 == 1 ? torch::randn({10, 3, 5, 5}) * 3 + 100 : torch::randn({10, 3, 5, 5});
        for (const auto& micro : x.chunk(4)) deferred->forward(micro);
        plain->forward(x);
        CHECK(deferred->pending_micro_batches() == 0);
        CHECK(close(bn->running_mean, plain->running_mean));
        CHECK(close(bn->running_var, plain->running_var));
        CHECK(bn->num_batches_tracked.item<int64_t>() == step + 1);
      }
    }
  }

  TEST_CASE("outputs and gradients equal batch norm applied chunk by chunk") {
    torch::manual_seed(2);
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    auto plain = copy_of(bn);
    sw::DeferredBatchNorm deferred(*bn, 3);
    auto x = torch::randn({9, 3, 4, 4});
    auto chunks = x.chunk(3);
    std::vector<torch::Tensor> got, want;
    for (const auto& c : chunks) {
      got.push_back(deferred->forward(c));
      want.push_back(plain->forward(c));
    }
    CHECK(close(torch::cat(got), torch::cat(want)));
    (torch::cat(got) * torch::arange(9).view({9, 1, 1, 1})).sum().backward();
    (torch::cat(want) * torch::arange(9).view({9, 1, 1, 1})).sum().backward();
    CHECK(close(bn->weight.grad(), plain->weight.grad()));
    CHECK(close(bn->bias.grad(), plain->bias.grad()));
  }

  TEST_CASE("it shares the parameters and buffers of the batch norm it replaces") {
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    sw::DeferredBatchNorm deferred(*bn, 2);
    CHECK(deferred->weight.is_same(bn->weight));
    CHECK(deferred->bias.is_same(bn->bias));
    CHECK(deferred->running_mean.is_same(bn->running_mean));
    CHECK(deferred->running_var.is_same(bn->running_var));
    CHECK(deferred->num_batches_tracked.is_same(bn->num_batches_tracked));
    CHECK(deferred->parameters().size() == 2);
    CHECK(deferred->buffers().size() == 3);
  }

  TEST_CASE("a recomputed micro-batch is not counted") {
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    const auto before = bn->running_mean.clone();
    sw::DeferredBatchNorm deferred(*bn, 1);
    {
      auto scope = sw::detail::recomputing_scope();
      deferred->forward(torch::randn({4, 3, 2, 2}));
    }
    CHECK(deferred->pending_micro_batches() == 0);
    CHECK(bn->running_mean.equal(before));
    CHECK(bn->num_batches_tracked.item<int64_t>() == 0);
  }

  TEST_CASE("eval is plain batch norm with the running statistics") {
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    auto plain = copy_of(bn);
    sw::DeferredBatchNorm deferred(*bn, 2);
    deferred->eval();
    plain->eval();
    auto x = torch::randn({5, 3, 2, 2});
    CHECK(deferred->forward(x).equal(plain->forward(x)));
    CHECK(deferred->pending_micro_batches() == 0);
    CHECK(bn->num_batches_tracked.item<int64_t>() == 0);
  }

  TEST_CASE("begin_mini_batch sets how many micro-batches the next mini-batch has") {
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    auto plain = copy_of(bn);
    sw::DeferredBatchNorm deferred(*bn, 4);
    deferred->forward(torch::randn({2, 3, 2, 2}));  // left over, dropped by begin_mini_batch
    CHECK(deferred->pending_micro_batches() == 1);
    deferred->begin_mini_batch(2);
    auto x = torch::randn({6, 3, 2, 2});
    deferred->forward(x.slice(0, 0, 3));
    CHECK(deferred->pending_micro_batches() == 1);
    deferred->forward(x.slice(0, 3, 6));
    plain->forward(x);
    CHECK(deferred->pending_micro_batches() == 0);
    CHECK(close(bn->running_mean, plain->running_mean));
    CHECK(close(bn->running_var, plain->running_var));
    // Afterwards, chunks from the constructor again.
    for (int i = 0; i < 3; ++i) deferred->forward(torch::randn({2, 3, 2, 2}));
    CHECK(deferred->pending_micro_batches() == 3);
    CHECK(contains(error_of([&] { deferred->begin_mini_batch(0); }),
                   "a mini-batch has at least one micro-batch, got 0"));
  }

  TEST_CASE("a clone owns copies of everything") {
    auto bn = make_bn(torch::nn::BatchNormOptions(3));
    sw::DeferredBatchNorm deferred(*bn, 2);
    auto copy = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(deferred->clone());
    REQUIRE(copy);
    CHECK(!copy->weight.is_same(bn->weight));
    CHECK(copy->weight.equal(bn->weight));
    CHECK(copy->weight.requires_grad());
    CHECK(copy->running_var.equal(bn->running_var));
    CHECK(!copy->running_var.is_same(bn->running_var));
    CHECK(copy->named_parameters()["weight"].is_same(copy->weight));
    CHECK(copy->named_buffers()["running_var"].is_same(copy->running_var));
    CHECK(copy->chunks() == 2);
  }

  TEST_CASE("convert_deferred_batch_norm swaps BatchNorm1d, 2d and 3d") {
    torch::nn::BatchNorm1d bn1(4);
    torch::nn::BatchNorm3d bn3(2);
    torch::nn::Linear linear(4, 4);
    torch::nn::BatchNorm2d bn2(2);
    torch::nn::Sequential model(
        linear, bn1, bn2, bn3,
        torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(4).track_running_stats(false)));
    auto converted = sw::convert_deferred_batch_norm(model, 4);
    REQUIRE(converted->size() == 5);
    CHECK(converted[0].get() == linear.get());
    auto d1 = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(converted[1]);
    REQUIRE(d1);
    CHECK(d1->spatial_dims() == 1);
    CHECK(d1->chunks() == 4);
    CHECK(d1->running_mean.is_same(bn1->running_mean));
    auto d2 = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(converted[2]);
    REQUIRE(d2);
    CHECK(d2->spatial_dims() == 2);
    CHECK(d2->weight.is_same(bn2->weight));
    auto d3 = std::dynamic_pointer_cast<sw::DeferredBatchNormImpl>(converted[3]);
    REQUIRE(d3);
    CHECK(d3->spatial_dims() == 3);
    // No running statistics: nothing to defer, kept as it is.
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(converted[4]));
    // The original is untouched.
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(model[1]));
    CHECK(converted->named_children()[3].key() == "3");
  }

  TEST_CASE("a batch norm inside a custom module is an error naming it") {
    torch::nn::Sequential model(torch::nn::Linear(4, 4), Hidden());
    const auto message = error_of([&] { sw::convert_deferred_batch_norm(model, 2); });
    CHECK(contains(message, "deferred batch norm cannot reach the batch norm '1.bn'"));
    CHECK(contains(message, "Build that module with stagewise::DeferredBatchNorm in its place"));
  }

  TEST_CASE("bad arguments are errors that say what to give") {
    torch::nn::Sequential model(torch::nn::Linear(4, 4));
    CHECK(contains(error_of([&] { sw::convert_deferred_batch_norm(model, 0); }),
                   "chunks must be positive, got 0"));
    CHECK(contains(error_of([] { sw::DeferredBatchNorm(4, torch::nn::BatchNormOptions(2)); }),
                   "spatial_dims must be 1, 2 or 3"));
    torch::nn::BatchNorm2d untracked(torch::nn::BatchNormOptions(2).track_running_stats(false));
    CHECK(contains(error_of([&] { sw::DeferredBatchNorm(*untracked, 2); }),
                   "the batch norm has no running statistics"));
    sw::DeferredBatchNorm d(2, torch::nn::BatchNormOptions(2));
    CHECK(contains(error_of([&] {
                     d->forward(torch::randn({2, 2}));
                   }),
                   "expected a 4D input (like BatchNorm2d), got 2D"));
  }
}
