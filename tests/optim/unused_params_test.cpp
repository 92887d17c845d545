// Parameters that get no gradient in some steps (a branch used on alternate steps, an expert
// without tokens): the fused step skips them, as an unfused optimizer does when gradients are
// reset to none between steps, and finish_step reports only real errors.
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// trunk -> (branch, on steps that use it) -> head. The branch's parameters get no gradient on
// the other steps; with `rows_over`, only micro-batches with more rows than that use it.
struct GatedImpl : torch::nn::Module {
  GatedImpl() {
    torch::manual_seed(5);
    trunk = register_module("trunk", torch::nn::Linear(6, 8));
    branch = register_module("branch", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(trunk->forward(x));
    if (use_branch && x.size(0) > rows_over) h = h + torch::tanh(branch->forward(h));
    return head->forward(h);
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr}, head{nullptr};
  bool use_branch = true;
  int64_t rows_over = 0;
};
TORCH_MODULE(Gated);

using Factory = sw::optim::OptimizerFactory;

// Every optimizer FusedStep supports, in the settings where skipping a step matters most
// (momentum buffers, step counts, weight decay).
std::vector<std::pair<std::string, Factory>> every_optimizer() {
  namespace o = torch::optim;
  using sw::optim::make_optimizer_factory;
  return {
      {"SGD", make_optimizer_factory(o::SGDOptions(0.1))},
      {"SGD momentum", make_optimizer_factory(o::SGDOptions(0.1).momentum(0.9).weight_decay(1e-2))},
      {"SGD nesterov", make_optimizer_factory(o::SGDOptions(0.1).momentum(0.9).nesterov(true))},
      {"Adam", make_optimizer_factory(o::AdamOptions(1e-2))},
      {"Adam amsgrad", make_optimizer_factory(o::AdamOptions(1e-2).amsgrad(true))},
      {"AdamW", make_optimizer_factory(o::AdamWOptions(1e-2).weight_decay(0.1))},
      {"RMSprop", make_optimizer_factory(o::RMSpropOptions(1e-2).momentum(0.5).centered(true))},
      {"Adagrad", make_optimizer_factory(o::AdagradOptions(1e-1))},
  };
}

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

// The reference: the unfused optimizer with gradients reset to none between steps (LibTorch
// 1.13's zero_grad() zeroes them instead, which moves the state of unused parameters).
void reset_to_none(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

bool bit_equal(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    if (!pa[i].equal(pb[i])) return false;
  }
  return true;
}

// 10 steps, the branch used on even steps only, `micro` backward passes per step (with
// `rows_over`, the branch is used by the first micro-batch only).
void check_alternate_steps(const Factory& factory, int micro, int64_t rows_over) {
  Gated fused_net, plain_net;
  fused_net->rows_over = plain_net->rows_over = rows_over;
  sw::optim::FusedStep fused(fused_net->named_parameters(), factory);
  fused.set_accumulation_steps(micro);
  auto plain = factory(plain_net->parameters());
  torch::manual_seed(9);
  for (int step = 0; step < 10; ++step) {
    fused_net->use_branch = plain_net->use_branch = step % 2 == 0;
    for (int m = 0; m < micro; ++m) {
      auto x = torch::randn({m == 0 ? 4 : 3, 6});
      auto t = torch::randn({x.size(0), 3});
      mse(fused_net->forward(x), t).backward();
      mse(plain_net->forward(x), t).backward();
    }
    fused.finish_step();
    plain->step();
    reset_to_none(*plain_net);
    for (auto& p : fused_net->parameters()) CHECK_FALSE(p.grad().defined());
  }
  CHECK(bit_equal(*fused_net, *plain_net));
  // The branch did move (it is not trivially equal because nothing happened).
  CHECK_FALSE(fused_net->branch->weight.equal(Gated()->branch->weight));
}

}  // namespace

TEST_SUITE("fused step: parameters without a gradient skip the step") {
  TEST_CASE("a branch used on alternate steps, every optimizer, 10 steps: bit-identical") {
    for (const auto& [name, factory] : every_optimizer()) {
      CAPTURE(name);
      check_alternate_steps(factory, /*micro=*/1, /*rows_over=*/0);
    }
  }
  TEST_CASE("with 2 micro-batches of which only the first reaches the branch: bit-identical") {
    for (const auto& [name, factory] : every_optimizer()) {
      CAPTURE(name);
      check_alternate_steps(factory, /*micro=*/2, /*rows_over=*/3);
    }
  }
  TEST_CASE("LibTorch 1.13's zeroing zero_grad() moves unused parameters: reset to none matches") {
    // Why the reference resets to none: with momentum, a zeroed gradient still steps.
    Gated a, b;
    auto factory = sw::optim::make_optimizer_factory(torch::optim::SGDOptions(0.1).momentum(0.9));
    auto zeroing = factory(a->parameters());
    sw::optim::FusedStep fused(b->parameters(), factory);
    auto x = torch::randn({4, 6});
    for (int step = 0; step < 2; ++step) {
      a->use_branch = b->use_branch = step == 0;
      for (auto& p : a->parameters()) {
        if (p.grad().defined()) p.mutable_grad().zero_();  // what 1.13's zero_grad() does
      }
      mse(a->forward(x), torch::zeros({4, 3})).backward();
      zeroing->step();
      mse(b->forward(x), torch::zeros({4, 3})).backward();
      fused.finish_step();
    }
    // Step 2: the zeroed gradient let momentum move the branch once more; the fused step did not.
    CHECK_FALSE(a->branch->weight.equal(b->branch->weight));
    CHECK(a->trunk->weight.equal(b->trunk->weight));  // the used parameters agree
  }
}

TEST_SUITE("fused step: finish_step, lenient and strict") {
  TEST_CASE("by default a parameter without a gradient is not an error; stepped_this_step says") {
    Gated net;
    net->use_branch = false;
    sw::optim::FusedStep fused(net->named_parameters(), torch::optim::SGDOptions(0.1));
    CHECK_FALSE(fused.strict());
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(fused.stepped_this_step() == 4);  // trunk and head, weight and bias
    fused.finish_step();
    CHECK(fused.stepped_this_step() == 0);
  }
  TEST_CASE("a parameter that stepped twice is reported in both modes, with the fix") {
    for (bool strict : {false, true}) {
      Gated net;
      sw::optim::FusedStep fused(net->named_parameters(), torch::optim::SGDOptions(0.1));
      fused.set_strict(strict);
      const auto x = torch::randn({4, 6});
      mse(net->forward(x), torch::zeros({4, 3})).backward();
      net->use_branch = false;
      mse(net->forward(x), torch::zeros({4, 3})).backward();  // a second pass with k = 1
      const auto error = error_of([&] { fused.finish_step(); });
      if (strict) {
        CHECK(contains(error,
                       "stagewise::optim::FusedStep::finish_step (strict): 4 of 6 parameters did "
                       "not get exactly k gradients and step once: parameter 'trunk.weight' "
                       "(shape [8, 6]) stepped 2 times; "));
        CHECK(contains(error, "call set_strict(false) to let it skip the step"));
      } else {
        CHECK(contains(error,
                       "stagewise::optim::FusedStep::finish_step: 4 of 6 parameters stepped more "
                       "than once this step: parameter 'trunk.weight' (shape [8, 6]) stepped 2 "
                       "times; parameter 'trunk.bias' (shape [8]) stepped 2 times; "));
        CHECK(contains(error, "Set set_accumulation_steps(k) to the number of backward passes"));
      }
      CHECK_FALSE(contains(error, "branch.weight"));  // one gradient: stepped once
      CHECK(fused.stepped_this_step() == 0);          // the counts were reset
    }
  }
  TEST_CASE("k = 2 and three gradients: stepped once, then one more pending is reported") {
    Gated net;
    sw::optim::FusedStep fused(net->named_parameters(), torch::optim::SGDOptions(0.1));
    fused.set_accumulation_steps(2);
    net->use_branch = false;
    for (int i = 0; i < 3; ++i)
      mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(contains(error_of([&] { fused.finish_step(); }),
                   "parameter 'trunk.weight' (shape [8, 6]) stepped 1 time and then got 1 more "
                   "gradients"));
    for (auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());  // pending freed
  }
  TEST_CASE("strict mode reports a parameter with no gradient and one with fewer than k") {
    Gated net;
    net->rows_over = 3;
    sw::optim::FusedStep fused(net->named_parameters(), torch::optim::SGDOptions(0.1));
    fused.set_strict(true);
    fused.set_accumulation_steps(2);
    const auto branch_before = net->branch->weight.detach().clone();
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();  // uses the branch
    mse(net->forward(torch::randn({3, 6})), torch::zeros({4, 3}).narrow(0, 0, 3)).backward();
    CHECK(error_of([&] { fused.finish_step(); }) ==
          "stagewise::optim::FusedStep::finish_step (strict): 2 of 6 parameters did not get "
          "exactly k gradients and step once: parameter 'branch.weight' (shape [8, 8]) got 1 of "
          "its 2 gradients; parameter 'branch.bias' (shape [8]) got 1 of its 2 gradients. Set "
          "set_accumulation_steps(k) to the number of backward passes per step and "
          "set_accumulation_steps(k, params) for parameters that get several gradients per "
          "backward (a layer recomputed twice). A parameter that is not used in every step (an "
          "expert that got no tokens) is normal: call set_strict(false) to let it skip the step, "
          "as unfused optimizers do.");
    CHECK(net->branch->weight.equal(branch_before));  // not stepped on a partial gradient
    CHECK_FALSE(net->branch->weight.grad().defined());
    net->use_branch = false;
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(contains(error_of([&] { fused.finish_step(); }),
                   "parameter 'branch.weight' (shape [8, 8]) got no gradient; parameter "
                   "'branch.bias' (shape [8]) got no gradient."));
    fused.set_strict(false);  // the same step is fine when lenient
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    fused.finish_step();
  }
  TEST_CASE(
      "by default a parameter with fewer than k gradients steps on their sum at finish_step") {
    Gated fused_net, plain_net;
    fused_net->rows_over = plain_net->rows_over = 3;
    sw::optim::FusedStep fused(fused_net->parameters(), torch::optim::SGDOptions(0.1));
    fused.set_accumulation_steps(2);
    torch::optim::SGD plain(plain_net->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t rows : {4, 3}) {
      auto x = torch::randn({rows, 6});
      mse(fused_net->forward(x), torch::zeros({rows, 3})).backward();
      mse(plain_net->forward(x), torch::zeros({rows, 3})).backward();
    }
    CHECK(fused.stepped_this_step() == 4);  // trunk and head; the branch waits for a 2nd gradient
    CHECK(fused_net->branch->weight.grad().defined());
    fused.finish_step();
    plain.step();
    CHECK_FALSE(fused_net->branch->weight.grad().defined());
    CHECK(bit_equal(*fused_net, *plain_net));
  }
  TEST_CASE("set_strict is between steps only") {
    Gated net;
    sw::optim::FusedStep fused(net->named_parameters(), torch::optim::SGDOptions(0.1));
    fused.set_accumulation_steps(2);
    mse(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(contains(error_of([&] { fused.set_strict(true); }),
                   "stagewise::optim::FusedStep::set_strict: parameter 'trunk.weight' (shape [8, "
                   "6]) is part-way through accumulating. Call it between steps"));
    fused.reset_step();
    fused.set_strict(true);
    CHECK(fused.strict());
  }
}

namespace {

// The second stage of the pipe below: the branch (maybe) and the head.
struct TailImpl : torch::nn::Module {
  TailImpl() {
    branch = register_module("branch", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& h) {
    if (!use_branch || h.size(0) <= rows_over) return head->forward(h);
    return head->forward(h + torch::tanh(branch->forward(h)));
  }
  torch::nn::Linear branch{nullptr}, head{nullptr};
  bool use_branch = true;
  int64_t rows_over = 3;
};
TORCH_MODULE(Tail);

// A pipe of two stages, the second gated; with 2 micro-batches of 4 and 3 rows, `rows_over = 3`
// lets only the first micro-batch reach the branch.
struct PipeRun {
  explicit PipeRun(sw::Checkpoint mode) {
    torch::manual_seed(5);
    torch::nn::Sequential first(torch::nn::Linear(6, 8), torch::nn::Functional(torch::tanh));
    tail = Tail();
    pipe = sw::Pipe(sw::stages(first, tail), sw::PipeOptions().chunks(2).checkpoint(mode));
  }
  Tail tail{nullptr};
  sw::Pipe<torch::nn::Sequential, Tail> pipe{nullptr};
};

}  // namespace

TEST_SUITE("fused step in a pipe's train_step: parameters without a gradient") {
  TEST_CASE("a branch used on alternate steps and by one micro-batch: bit-identical, every mode") {
    for (auto mode : {sw::Checkpoint::never, sw::Checkpoint::except_last, sw::Checkpoint::always}) {
      for (const auto& [name, factory] : every_optimizer()) {
        CAPTURE(name);
        PipeRun fused_run(mode), plain_run(mode);
        sw::optim::FusedStep fused(fused_run.pipe->parameters(), factory);
        auto plain = factory(plain_run.pipe->parameters());
        torch::manual_seed(3);
        for (int step = 0; step < 10; ++step) {
          fused_run.tail->use_branch = plain_run.tail->use_branch = step % 2 == 0;
          auto x = torch::randn({7, 6});
          auto t = torch::randn({7, 3});
          auto a = fused_run.pipe->train_step(x, t, mse, fused);
          auto b = plain_run.pipe->train_step(x, t, mse);
          plain->step();
          reset_to_none(*plain_run.pipe);
          CHECK(a.item<float>() == b.item<float>());
        }
        CHECK(bit_equal(*fused_run.pipe, *plain_run.pipe));
      }
    }
  }
  TEST_CASE("in strict mode train_step reports the unused branch and the next step works") {
    PipeRun run(sw::Checkpoint::except_last);
    sw::optim::FusedStep fused(run.pipe->named_parameters(), torch::optim::AdamOptions(1e-2));
    fused.set_strict(true);
    run.tail->use_branch = false;
    const auto error = error_of([&] {
      run.pipe->train_step(torch::randn({7, 6}), torch::randn({7, 3}), mse, fused);
    });
    CHECK(contains(error, "stagewise::optim::FusedStep::finish_step (strict): 2 of 6 parameters"));
    CHECK(contains(error, "'stage1.branch.weight' (shape [8, 8]) got no gradient"));
    run.tail->use_branch = true;
    CHECK(contains(error_of([&] {
                     run.pipe->train_step(torch::randn({7, 6}), torch::randn({7, 3}), mse, fused);
                   }),
                   "'stage1.branch.weight' (shape [8, 8]) got 1 of its 2 gradients"));
    run.tail->rows_over = 0;  // both micro-batches use it: every parameter gets k = 2
    run.pipe->train_step(torch::randn({7, 6}), torch::randn({7, 3}), mse, fused);
    CHECK(fused.stepped_this_step() == 0);
  }
}
