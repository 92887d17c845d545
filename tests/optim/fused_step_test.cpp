#include "tests/optim/test_models.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <exception>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
namespace optim = torch::optim;
using test::Net;
using test::NetConfig;

static_assert(sw::optim::fusable_options<optim::SGDOptions>);
static_assert(sw::optim::fusable_options<optim::AdamOptions>);
static_assert(sw::optim::fusable_options<optim::AdamWOptions>);
static_assert(sw::optim::fusable_options<const optim::RMSpropOptions&>);
static_assert(!sw::optim::fusable_options<optim::LBFGSOptions>);  // its step needs a closure
static_assert(!sw::optim::fusable_options<int>);
static_assert(!std::is_copy_constructible_v<sw::optim::FusedStep>);
static_assert(std::is_nothrow_move_constructible_v<sw::optim::FusedStep>);

namespace {

// Post hooks on a parameter's AccumulateGrad node (creating the node if there is none).
std::size_t hooks_on(const torch::Tensor& p) {
  return torch::autograd::impl::grad_accumulator(p)->post_hooks().size();
}

struct FusedRun {
  Net net;
  bool grads_always_empty = true;  // after every step's last backward
  int stale_recomputes = 0;        // recomputes that saw weights already updated this step
};

// `steps` fused steps. The recompute probe compares the block's weight with its value at the
// start of the step.
template <class Options>
FusedRun train_fused(Options options, NetConfig cfg, int steps = 10, int block_k = 0) {
  FusedRun run{test::make_net(cfg)};
  auto& net = run.net;
  struct ProbeReset {
    ~ProbeReset() { test::on_recompute() = nullptr; }
  } probe_reset;
  sw::optim::FusedStep fused(net->named_parameters(), options);
  fused.set_accumulation_steps(cfg.micro_batches);
  if (block_k) fused.set_accumulation_steps(block_k, net->b->parameters());
  torch::Tensor snapshot;
  test::on_recompute() = [&] {
    if (!torch::equal(net->b->weight, snapshot)) ++run.stale_recomputes;
  };
  for (int s = 0; s < steps; ++s) {
    snapshot = net->b->weight.detach().clone();
    test::forward_backward(net, s);
    run.grads_always_empty = run.grads_always_empty && test::all_grads_empty(net->parameters());
    fused.finish_step();
  }
  return run;
}

template <class Options>
void check_exact(Options options, NetConfig cfg, int block_k = 0) {
  auto reference = test::train_unfused(options, cfg);
  auto fused = train_fused(options, cfg, 10, block_k);
  CHECK(test::max_abs_diff(reference->parameters(), fused.net->parameters()) == 0.0);
  CHECK(fused.grads_always_empty);
  CHECK(fused.stale_recomputes == 0);
}

const auto sgd = optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(1e-2);
const auto adam = optim::AdamOptions(1e-2).weight_decay(1e-3);
const auto adamw = optim::AdamWOptions(1e-2).weight_decay(1e-2);

}  // namespace

TEST_SUITE("fused step equals the unfused optimizer bit for bit") {
  TEST_CASE("SGD with momentum and weight decay: 10 steps, every .grad empty after backward") {
    check_exact(sgd, {});
    check_exact(optim::SGDOptions(0.05).momentum(0.9).nesterov(true), {});
  }
  TEST_CASE("Adam with weight decay, and with amsgrad: 10 steps") {
    check_exact(adam, {});
    check_exact(optim::AdamOptions(1e-2).amsgrad(true), {});
  }
  TEST_CASE("AdamW: 10 steps") {
    check_exact(adamw, {});
  }
  // torch::load(module, file) replaces each parameter's storage with set_, and autograd then
  // builds a new AccumulateGrad node for it, without the hook: the parameter would silently stop
  // stepping.
  TEST_CASE("parameters whose storage was replaced (torch::load) are hooked again and step") {
    auto reference = test::train_unfused(adam, {}, 4);
    auto replace_storage = [](const test::Net& net) {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.set_(p.detach().clone());
    };
    {  // finish_step after every step: it steps on what the lost hook missed, and hooks again.
      auto net = test::make_net({});
      sw::optim::FusedStep fused(net->parameters(), adam);
      for (int s = 0; s < 4; ++s) {
        if (s == 2) replace_storage(net);
        test::forward_backward(net, s);
        fused.finish_step();
      }
      CHECK(test::max_abs_diff(reference->parameters(), net->parameters()) == 0.0);
      CHECK(test::all_grads_empty(net->parameters()));
    }
    {  // attach() after the load hooks them again before the next backward.
      auto net = test::make_net({});
      sw::optim::FusedStep fused(net->parameters(), adam);
      for (int s = 0; s < 4; ++s) {
        if (s == 2) {
          replace_storage(net);
          fused.attach();
        }
        test::forward_backward(net, s);
        CHECK(test::all_grads_empty(net->parameters()));
      }
      CHECK(test::max_abs_diff(reference->parameters(), net->parameters()) == 0.0);
    }
  }

  TEST_CASE("RMSprop and Adagrad, passed as options or through a factory") {
    check_exact(optim::RMSpropOptions(1e-2).momentum(0.5), {});
    check_exact(optim::AdagradOptions(1e-1), {});
    auto reference = test::train_unfused(optim::RMSpropOptions(1e-2).centered(true), {});
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), [](std::vector<torch::Tensor> p) {
      return std::make_unique<optim::RMSprop>(std::move(p),
                                              optim::RMSpropOptions(1e-2).centered(true));
    });
    for (int s = 0; s < 10; ++s) test::forward_backward(net, s);
    CHECK(test::max_abs_diff(reference->parameters(), net->parameters()) == 0.0);
  }
  TEST_CASE(
      "with k accumulation steps only the k-th backward steps; equal to accumulate-then-step") {
    NetConfig cfg{.micro_batches = 3};
    check_exact(sgd, cfg);
    check_exact(adam, cfg);
    // Before the last micro-batch the gradients are there, accumulating as usual.
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), adam);
    fused.set_accumulation_steps(2);
    const auto before = net->a->weight.detach().clone();
    torch::mse_loss(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(net->a->weight.grad().defined());
    CHECK(torch::equal(net->a->weight, before));
    CHECK(fused.stepped_this_step() == 0);
    torch::mse_loss(net->forward(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    CHECK(test::all_grads_empty(net->parameters()));
    CHECK_FALSE(torch::equal(net->a->weight, before));
    CHECK(fused.stepped_this_step() == 6);
    fused.finish_step();
  }
  TEST_CASE(
      "set_lr reaches every per-parameter optimizer, as a scheduler does on the unfused one") {
    auto reference = test::make_net({});
    optim::Adam opt(reference->parameters(), adam);
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), adam);
    for (int s = 0; s < 10; ++s) {
      const double lr = 1e-2 * std::pow(0.7, s);
      for (auto& group : opt.param_groups()) group.options().set_lr(lr);
      fused.set_lr(lr);
      CHECK(fused.lr() == lr);
      test::forward_backward(reference, s);
      opt.step();
      opt.zero_grad();
      test::forward_backward(net, s);
    }
    CHECK(test::max_abs_diff(reference->parameters(), net->parameters()) == 0.0);
  }
}

TEST_SUITE("fused step under checkpointing (stand-in for stagewise::checkpoint)") {
  TEST_CASE(
      "a checkpointed layer is recomputed with the not-yet-updated weights; SGD, Adam, AdamW "
      "exact") {
    NetConfig cfg{.checkpoint = true};
    check_exact(sgd, cfg);
    check_exact(adam, cfg);
    check_exact(adamw, cfg);
  }
  TEST_CASE(
      "over micro-batches, every micro-batch's recompute sees the weights of the step's start") {
    NetConfig cfg{.checkpoint = true, .micro_batches = 4};
    check_exact(adam, cfg);
  }
  TEST_CASE("the same layer recomputed twice per backward steps on its 2nd gradient and is exact") {
    NetConfig cfg{.checkpoint = true, .twice = true};
    check_exact(adam, cfg, /*block_k=*/2);
    check_exact(sgd, NetConfig{.checkpoint = true, .twice = true, .micro_batches = 2}, 4);
  }
  TEST_CASE(
      "without k=2 for that layer, its second recompute sees updated weights and finish_step says "
      "so") {
    NetConfig cfg{.checkpoint = true, .twice = true};
    auto run = [&] { train_fused(adam, cfg, 1); };
    CHECK_THROWS_WITH(run(),
                      doctest::Contains("parameter 'b.weight' (shape [16, 16]) stepped 2 times"));
    FusedRun r{test::make_net(cfg)};
    sw::optim::FusedStep fused(r.net->parameters(), adam);
    const auto start = r.net->b->weight.detach().clone();
    test::on_recompute() = [&] { r.stale_recomputes += !torch::equal(r.net->b->weight, start); };
    test::forward_backward(r.net, 0);
    test::on_recompute() = nullptr;
    CHECK(r.stale_recomputes == 1);
  }
  TEST_CASE(
      "one backward over M micro-batches: a checkpointed layer gets one gradient per recompute "
      "plus one for the rest (always: M, except_last: M, never: 1)") {
    constexpr int m = 3;
    for (int checkpointed : {m, m - 1, 0}) {
      const int k = checkpointed + (checkpointed < m ? 1 : 0);
      CAPTURE(checkpointed);
      auto train = [&](bool fuse, int* stale) {
        auto net = test::make_net({});
        std::unique_ptr<sw::optim::FusedStep> fused;
        std::unique_ptr<optim::Adam> opt;
        if (fuse) {
          fused = std::make_unique<sw::optim::FusedStep>(net->parameters(), adam);
          fused->set_accumulation_steps(k, net->b->parameters());  // a and c: 1, summed by autograd
        } else {
          opt = std::make_unique<optim::Adam>(net->parameters(), adam);
        }
        torch::Tensor start;
        test::on_recompute() = [&] { *stale += !torch::equal(net->b->weight, start); };
        for (int s = 0; s < 5; ++s) {
          start = net->b->weight.detach().clone();
          torch::manual_seed(4000 + s);
          auto xs = torch::randn({6, 6}).chunk(m);
          std::vector<torch::Tensor> outs;
          for (int i = 0; i < m; ++i) {
            auto h = torch::tanh(net->a(xs[i]));
            h = i < checkpointed ? test::CheckpointStandIn::apply(h, &net->block_fn)
                                 : net->block_fn(h);
            outs.push_back(net->c_(h));
          }
          torch::cat(outs).pow(2).mean().backward();  // one backward for all micro-batches
          if (fused) {
            fused->finish_step();
          } else {
            opt->step();
            opt->zero_grad();
          }
        }
        test::on_recompute() = nullptr;
        return net->parameters();
      };
      int stale = 0;
      const auto reference = train(false, &stale);
      const auto result = train(true, &stale);
      CHECK(test::max_abs_diff(reference, result) == 0.0);
      CHECK(stale == 0);
    }
  }
}

TEST_SUITE("fused step in a pipeline stand-in: stages step on their own backward threads") {
  // Two stages, M micro-batches. Stage 1's backward runs on one thread, stage 0's on another,
  // fed micro-batch by micro-batch, so the stages' backward passes and steps overlap.
  // Stage 0: Linear -> tanh -> (checkpointed) Linear -> tanh.
  struct Stage0Impl : torch::nn::Module {
    explicit Stage0Impl(bool ckpt) : checkpoint(ckpt) {
      l0 = register_module("l0", torch::nn::Linear(6, 16));
      l1 = register_module("l1", torch::nn::Linear(16, 16));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto h = torch::tanh(l0(x));
      return checkpoint ? test::CheckpointStandIn::apply(h, &fn) : fn(h);
    }
    bool checkpoint;
    torch::nn::Linear l0{nullptr}, l1{nullptr};
    test::LayerFn fn = [this](const torch::Tensor& h) { return torch::tanh(l1(h)); };
  };
  TORCH_MODULE(Stage0);

  void pipeline_step(Stage0 & s0, torch::nn::Sequential & s1, int step, int m, bool threaded) {
    torch::manual_seed(2000 + step);
    auto xs = torch::randn({8, 6}).chunk(m);
    auto ys = torch::randn({8, 3}).chunk(m);
    std::vector<torch::Tensor> h(m), h_in(m), loss(m);
    for (int i = 0; i < m; ++i) {
      h[i] = s0->forward(xs[i]);
      h_in[i] = h[i].detach().requires_grad_(true);
      loss[i] = torch::mse_loss(s1->forward(h_in[i]), ys[i]) / m;
    }
    // An exception on either thread reaches the caller; stage 0 never waits for a gradient
    // that stage 1 will not send.
    std::vector<std::promise<torch::Tensor>> grads(m);
    std::exception_ptr error;
    auto stage1 = [&] {
      int i = m - 1;
      try {
        for (; i >= 0; --i) {
          loss[i].backward();
          grads[i].set_value(h_in[i].grad());
        }
      } catch (...) {
        for (; i >= 0; --i) grads[i].set_exception(std::current_exception());
      }
    };
    auto stage0 = [&] {
      try {
        for (int i = m - 1; i >= 0; --i) h[i].backward(grads[i].get_future().get());
      } catch (...) {
        error = std::current_exception();
      }
    };
    if (threaded) {
      std::thread t1(stage1), t0(stage0);
      t1.join();
      t0.join();
    } else {
      stage1();
      stage0();
    }
    if (error) std::rethrow_exception(error);
  }

  void check_pipeline(bool checkpoint) {
    auto make = [&] {
      torch::manual_seed(3);
      Stage0 s0(checkpoint);
      torch::nn::Sequential s1(torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 3));
      return std::make_pair(s0, s1);
    };
    constexpr int m = 4;
    auto [r0, r1] = make();
    std::vector<torch::Tensor> ref_params = r0->parameters();
    for (auto& p : r1->parameters()) ref_params.push_back(p);
    optim::Adam opt(ref_params, adam);
    auto [f0, f1] = make();
    std::vector<torch::Tensor> params = f0->parameters();
    for (auto& p : f1->parameters()) params.push_back(p);
    sw::optim::FusedStep fused(params, adam);
    fused.set_accumulation_steps(m);
    for (int s = 0; s < 10; ++s) {
      pipeline_step(r0, r1, s, m, /*threaded=*/false);
      opt.step();
      opt.zero_grad();
      pipeline_step(f0, f1, s, m, /*threaded=*/true);
      CHECK(test::all_grads_empty(params));
      CHECK(fused.stepped_this_step() == static_cast<std::int64_t>(params.size()));
      fused.finish_step();
    }
    CHECK(test::max_abs_diff(ref_params, params) == 0.0);
  }

  TEST_CASE("two stages on two threads equal the unfused pipeline exactly") {
    check_pipeline(false);
  }
  TEST_CASE("the same with the first stage checkpointed (recompute on its thread)") {
    check_pipeline(true);
  }
}

TEST_SUITE("fused step: step boundaries and errors") {
  TEST_CASE("finish_step lets a parameter without a gradient skip; strict mode names it") {
    auto net = test::make_net({});
    auto unused = torch::zeros({2}, torch::requires_grad());
    auto named = net->named_parameters();
    named.insert("unused", unused);
    sw::optim::FusedStep fused(named, sgd);
    test::forward_backward(net, 0);
    fused.finish_step();  // as an unfused optimizer skips it
    fused.set_strict(true);
    test::forward_backward(net, 1);
    CHECK_THROWS_WITH(fused.finish_step(),
                      doctest::Contains("1 of 7 parameters did not get exactly k gradients and "
                                        "step once: parameter 'unused' (shape [2]) got no "
                                        "gradient."));
    test::forward_backward(net, 2);  // the counts were reset: the next step is checked afresh
    CHECK_THROWS_WITH(fused.finish_step(), doctest::Contains("'unused'"));
  }
  TEST_CASE("finish_step steps pending gradients; strict mode names them, and frees them") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), sgd);
    fused.set_accumulation_steps(2);
    auto before = net->parameters()[0].detach().clone();
    test::forward_backward(net, 0);
    fused.finish_step();
    CHECK_FALSE(net->parameters()[0].equal(before));
    CHECK(test::all_grads_empty(net->parameters()));
    fused.set_strict(true);
    before = net->parameters()[0].detach().clone();
    test::forward_backward(net, 0);
    CHECK_THROWS_WITH(fused.finish_step(),
                      doctest::Contains("parameter 0 (shape [16, 6]) got 1 of its 2 gradients"));
    CHECK(net->parameters()[0].equal(before));
    CHECK(test::all_grads_empty(net->parameters()));
  }
  TEST_CASE("set_accumulation_steps is checked") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), sgd);
    CHECK_THROWS_WITH(fused.set_accumulation_steps(0), doctest::Contains("Pass k >= 1"));
    CHECK_THROWS_WITH(fused.set_accumulation_steps(2, {torch::zeros({3})}),
                      doctest::Contains("a tensor of shape [3] is not one of this FusedStep's "
                                        "parameters"));
    fused.set_accumulation_steps(2);
    test::forward_backward(net, 0);
    CHECK_THROWS_WITH(fused.set_accumulation_steps(1),
                      doctest::Contains("is part-way through accumulating. Call it between steps"));
    fused.reset_step();
    fused.set_accumulation_steps(1);
  }
  TEST_CASE("construction rejects parameters it cannot step") {
    auto w = torch::zeros({2}, torch::requires_grad());
    CHECK_THROWS_WITH(sw::optim::FusedStep({torch::zeros({2})}, sgd),
                      doctest::Contains("parameter 0 (shape [2]) does not require grad"));
    CHECK_THROWS_WITH(sw::optim::FusedStep({w * 2}, sgd),
                      doctest::Contains("is not a leaf tensor"));
    CHECK_THROWS_WITH(sw::optim::FusedStep({w, w}, sgd), doctest::Contains("is listed twice"));
    CHECK_THROWS_WITH(sw::optim::FusedStep(std::vector<torch::Tensor>{}, sgd),
                      doctest::Contains("no parameters to optimize"));
    CHECK_THROWS_WITH(
        sw::optim::FusedStep(
            {w},
            [](std::vector<torch::Tensor>) {
              return std::make_unique<optim::SGD>(
                  std::vector<torch::Tensor>{torch::zeros({1}, torch::requires_grad())}, sgd);
            }),
        doctest::Contains("one param group holding exactly the parameters"));
    CHECK(hooks_on(w) == 0);  // nothing was attached by the failed constructions
  }
}

TEST_SUITE("fused step: hooks are never leaked") {
  TEST_CASE("detach restores ordinary backward and removes every hook; attach brings them back") {
    auto net = test::make_net({});
    const auto params = net->parameters();
    sw::optim::FusedStep fused(params, adam);
    for (const auto& p : params) CHECK(hooks_on(p) == 1);
    fused.detach();
    CHECK_FALSE(fused.attached());
    for (const auto& p : params) CHECK(hooks_on(p) == 0);
    const auto before = net->a->weight.detach().clone();
    test::forward_backward(net, 0);
    CHECK(net->a->weight.grad().defined());
    CHECK(torch::equal(net->a->weight, before));
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    fused.attach();
    fused.attach();  // idempotent
    for (const auto& p : params) CHECK(hooks_on(p) == 1);
    test::forward_backward(net, 1);
    CHECK(test::all_grads_empty(params));
    // A failed attach leaves no hook behind.
    fused.detach();
    net->c_->bias.requires_grad_(false);
    CHECK_THROWS_WITH(fused.attach(),
                      doctest::Contains("parameter 5 (shape [3]) no longer "
                                        "requires grad. Call requires_grad_(true)"));
    CHECK_FALSE(fused.attached());
    for (std::size_t i = 0; i + 1 < params.size(); ++i) CHECK(hooks_on(params[i]) == 0);
    net->c_->bias.requires_grad_(true);
    fused.attach();
    for (const auto& p : params) CHECK(hooks_on(p) == 1);
  }
  TEST_CASE("destroying a FusedStep removes its hooks; a rebuilt one installs one per parameter") {
    auto net = test::make_net({});
    const auto params = net->parameters();
    for (int round = 0; round < 3; ++round) {
      {
        sw::optim::FusedStep fused(params, sgd);
        for (const auto& p : params) CHECK(hooks_on(p) == 1);
        test::forward_backward(net, round);
      }
      for (const auto& p : params) CHECK(hooks_on(p) == 0);
    }
  }
  TEST_CASE("a moved FusedStep keeps stepping; the moved-to one drops what it held") {
    auto net = test::make_net({});
    const auto params = net->parameters();
    auto other = test::make_net({});
    sw::optim::FusedStep a(params, sgd);
    sw::optim::FusedStep b(other->parameters(), sgd);
    b = std::move(a);
    for (const auto& p : other->parameters()) CHECK(hooks_on(p) == 0);
    for (const auto& p : params) CHECK(hooks_on(p) == 1);
    sw::optim::FusedStep c(std::move(b));
    test::forward_backward(net, 0);
    CHECK(test::all_grads_empty(params));
    c.finish_step();
  }
}

TEST_SUITE("fused step: state in the unfused optimizer's layout") {
  template <class Optimizer, class Options>
  void check_round_trip(Options options) {
    // Reference: 6 unfused steps.
    auto reference = test::make_net({});
    Optimizer ref_opt(reference->parameters(), options);
    for (int s = 0; s < 6; ++s) {
      test::forward_backward(reference, s);
      ref_opt.step();
      ref_opt.zero_grad();
    }
    // Fused for 3 steps, saved, loaded into an unfused optimizer for the last 3.
    auto a = test::make_net({});
    std::stringstream file;
    {
      sw::optim::FusedStep fused(a->parameters(), options);
      for (int s = 0; s < 3; ++s) test::forward_backward(a, s);
      torch::save(fused, file);
    }
    Optimizer unfused(a->parameters(), options);
    torch::load(unfused, file);
    for (int s = 3; s < 6; ++s) {
      test::forward_backward(a, s);
      unfused.step();
      unfused.zero_grad();
    }
    CHECK(test::max_abs_diff(reference->parameters(), a->parameters()) == 0.0);
    // Unfused for 3 steps, saved, loaded into a FusedStep for the last 3.
    auto b = test::make_net({});
    std::stringstream file2;
    {
      Optimizer first(b->parameters(), options);
      for (int s = 0; s < 3; ++s) {
        test::forward_backward(b, s);
        first.step();
        first.zero_grad();
      }
      torch::save(first, file2);
    }
    for (auto& p : b->parameters()) p.mutable_grad().reset();
    sw::optim::FusedStep fused(b->parameters(), options);
    torch::load(fused, file2);
    for (int s = 3; s < 6; ++s) test::forward_backward(b, s);
    CHECK(test::max_abs_diff(reference->parameters(), b->parameters()) == 0.0);
  }

  TEST_CASE("Adam state saved by a fused step loads into an unfused Adam, and back, exactly") {
    check_round_trip<optim::Adam>(adam);
  }
  TEST_CASE("SGD momentum buffers and AdamW state round-trip the same way") {
    check_round_trip<optim::SGD>(sgd);
    check_round_trip<optim::AdamW>(adamw);
  }
  TEST_CASE("per-parameter state is what the unfused optimizer holds for that parameter") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->parameters(), adam);
    test::forward_backward(net, 0);
    test::forward_backward(net, 1);
    auto& state = fused.optimizer(0).state();
    REQUIRE(state.size() == 1);
    const auto& s = static_cast<const optim::AdamParamState&>(*state.begin()->second);
    CHECK(s.step() == 2);
    CHECK(s.exp_avg().sizes() == net->a->weight.sizes());
  }
}
