// Optimizer state one parameter at a time (what a pipe's save files under the model's names):
// every LibTorch optimizer but LBFGS writes each parameter's state and reads it back into an
// optimizer over other parameters, in another order and grouping, and then steps bit for bit as
// the one that saved it; FusedStep and the unfused optimizer read each other's; nothing else in
// the optimizer changes.

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace optim = torch::optim;
using sw::testing::error_of;

static_assert(sw::savable_optimizer<optim::Adam>);
static_assert(sw::savable_optimizer<sw::optim::FusedStep>);
static_assert(sw::parameter_state_optimizer<sw::optim::FusedStep>);
static_assert(!sw::parameter_state_optimizer<optim::Adam>);  // through the free functions
static_assert(!sw::savable_optimizer<int>);

namespace {

// Three parameters of different shapes, the same values for the same seed.
std::vector<torch::Tensor> params(int seed) {
  torch::manual_seed(seed);
  return {torch::randn({3, 4}).requires_grad_(), torch::randn({4}).requires_grad_(),
          torch::randn({2, 2}).requires_grad_()};
}

// Deterministic gradients for step `s`.
void set_grads(const std::vector<torch::Tensor>& ps, int s) {
  torch::manual_seed(100 + s);
  for (const auto& p : ps) p.mutable_grad() = torch::randn(p.sizes());
}

// What an archive holds once written to bytes and read back (as from a file).
std::unique_ptr<torch::serialize::InputArchive> reread(torch::serialize::OutputArchive& out) {
  std::stringstream bytes;
  out.save_to(bytes);
  auto in = std::make_unique<torch::serialize::InputArchive>();
  in->load_from(bytes);
  return in;
}

using Make =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::OptimizerParamGroup>)>;

template <class O, class Options>
Make maker(Options options) {
  return [options](std::vector<optim::OptimizerParamGroup> groups) {
    return std::make_unique<O>(std::move(groups), options);
  };
}

// Trains `a` over ps_a 3 steps, moves its state parameter by parameter into `b` (over ps_b, the
// same values, in reverse order and two groups), then steps both twice: equal bit for bit.
void check_round_trip(const Make& make) {
  auto ps_a = params(1), ps_b = params(1);
  auto a = make({optim::OptimizerParamGroup(ps_a)});
  for (int s = 0; s < 3; ++s) {
    set_grads(ps_a, s);
    a->step();
  }
  auto b =
      make({optim::OptimizerParamGroup({ps_b[2]}), optim::OptimizerParamGroup({ps_b[1], ps_b[0]})});
  for (std::size_t i = 0; i < ps_a.size(); ++i) {
    torch::NoGradGuard no_grad;
    ps_b[i].copy_(ps_a[i]);
  }
  for (std::size_t i = 0; i < ps_a.size(); ++i) {
    torch::serialize::OutputArchive out;
    REQUIRE(sw::optim::save_state(*a, ps_a[i], out));
    sw::optim::load_state(*b, ps_b[i], *reread(out));
  }
  for (int s = 3; s < 5; ++s) {
    set_grads(ps_a, s);
    set_grads(ps_b, s);
    a->step();
    b->step();
  }
  for (std::size_t i = 0; i < ps_a.size(); ++i) {
    CAPTURE(i);
    CHECK(torch::equal(ps_a[i], ps_b[i]));
  }
}

}  // namespace

TEST_SUITE("optimizer state by parameter") {
  TEST_CASE("each LibTorch optimizer's state moves parameter by parameter and steps on alike") {
    SUBCASE("SGD with momentum") {
      check_round_trip(maker<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9).nesterov(true)));
    }
    SUBCASE("Adam, amsgrad") {
      check_round_trip(maker<optim::Adam>(optim::AdamOptions(1e-2).amsgrad(true)));
    }
    SUBCASE("AdamW") {
      check_round_trip(maker<optim::AdamW>(optim::AdamWOptions(1e-2)));
    }
    SUBCASE("RMSprop, centered with momentum") {
      check_round_trip(
          maker<optim::RMSprop>(optim::RMSpropOptions(1e-2).centered(true).momentum(0.5)));
    }
    SUBCASE("Adagrad") {
      check_round_trip(maker<optim::Adagrad>(optim::AdagradOptions(1e-1)));
    }
  }

  TEST_CASE("loading leaves the other parameters' state and every group's options as they were") {
    auto ps = params(1);
    optim::Adam saver(ps, optim::AdamOptions(1e-2));
    set_grads(ps, 0);
    saver.step();
    torch::serialize::OutputArchive out;
    REQUIRE(sw::optim::save_state(saver, ps[0], out));

    auto qs = params(2);
    optim::Adam loader(
        {optim::OptimizerParamGroup({qs[0], qs[1]}), optim::OptimizerParamGroup({qs[2]})},
        optim::AdamOptions(1e-2));
    set_grads(qs, 1);
    loader.step();
    loader.param_groups()[0].options().set_lr(0.5);  // as a schedule would
    const auto other =
        static_cast<optim::AdamParamState&>(*loader.state()[sw::detail::optimizer_state_key(qs[1])])
            .exp_avg()
            .clone();
    sw::optim::load_state(loader, qs[0], *reread(out));
    CHECK(loader.param_groups().size() == 2);
    CHECK(loader.param_groups()[0].params().size() == 2);
    CHECK(loader.param_groups()[0].options().get_lr() == 0.5);
    CHECK(loader.state().size() == 3);
    const auto& loaded = static_cast<optim::AdamParamState&>(
        *loader.state()[sw::detail::optimizer_state_key(qs[0])]);
    const auto& saved =
        static_cast<optim::AdamParamState&>(*saver.state()[sw::detail::optimizer_state_key(ps[0])]);
    CHECK(torch::equal(loaded.exp_avg(), saved.exp_avg()));
    CHECK(loaded.step() == saved.step());
    CHECK(torch::equal(
        static_cast<optim::AdamParamState&>(*loader.state()[sw::detail::optimizer_state_key(qs[1])])
            .exp_avg(),
        other));
  }

  TEST_CASE("a parameter saved before its first step loads as never stepped") {
    auto ps = params(1);
    optim::SGD fresh(ps, optim::SGDOptions(0.1).momentum(0.9));
    torch::serialize::OutputArchive out;
    REQUIRE(sw::optim::save_state(fresh, ps[1], out));
    auto qs = params(1);
    optim::SGD trained(qs, optim::SGDOptions(0.1).momentum(0.9));
    set_grads(qs, 0);
    trained.step();
    REQUIRE(trained.state().size() == 3);
    sw::optim::load_state(trained, qs[1], *reread(out));
    CHECK(trained.state().size() == 2);
    CHECK(trained.state().count(sw::detail::optimizer_state_key(qs[1])) == 0);
  }

  TEST_CASE("FusedStep and the unfused optimizer read each other's state, parameter by parameter") {
    auto ps = params(1), qs = params(1), rs = params(1);
    optim::Adam unfused(ps, optim::AdamOptions(1e-2));
    sw::optim::FusedStep fused(qs, optim::AdamOptions(1e-2));
    CHECK(sw::optim::state_kind(unfused) == "torch::optim::AdamOptions");
    CHECK(fused.state_kind() == "torch::optim::AdamOptions");
    CHECK(fused.keeps_state(qs[2]));
    CHECK_FALSE(fused.keeps_state(ps[2]));
    for (int s = 0; s < 2; ++s) {
      set_grads(ps, s);
      unfused.step();
    }
    for (std::size_t i = 0; i < ps.size(); ++i) {  // unfused -> fused
      torch::NoGradGuard no_grad;
      qs[i].copy_(ps[i]);
      torch::serialize::OutputArchive out;
      REQUIRE(sw::optim::save_state(unfused, ps[i], out));
      fused.load_state(qs[i], *reread(out));
    }
    optim::Adam back(rs, optim::AdamOptions(1e-2));
    for (std::size_t i = 0; i < ps.size(); ++i) {  // fused -> unfused
      torch::NoGradGuard no_grad;
      rs[i].copy_(ps[i]);
      torch::serialize::OutputArchive out;
      REQUIRE(fused.save_state(qs[i], out));
      sw::optim::load_state(back, rs[i], *reread(out));
    }
    set_grads(ps, 2);
    set_grads(rs, 2);
    unfused.step();
    back.step();
    set_grads(qs, 2);
    fused.detach();  // step on the gradients set by hand
    for (std::size_t i = 0; i < qs.size(); ++i) fused.step_parameter(i);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      CAPTURE(i);
      CHECK(torch::equal(ps[i], qs[i]));
      CHECK(torch::equal(ps[i], rs[i]));
    }
  }

  TEST_CASE("LBFGS and tensors that are not parameters are refused, naming the fix") {
    auto ps = params(1);
    optim::LBFGS lbfgs(ps, optim::LBFGSOptions(0.1));
    torch::serialize::OutputArchive out;
    CHECK(error_of([&] { sw::optim::save_state(lbfgs, ps[0], out); }) ==
          "stagewise::optim::save_state: torch::optim::LBFGS keeps one history over all its "
          "parameters, which cannot be saved parameter by parameter; save it yourself "
          "(torch::save(lbfgs, file)) and the pipe with save(dir, step)");
    optim::Adam adam(ps, optim::AdamOptions(1e-2));
    const auto stranger = torch::zeros({5}, torch::requires_grad());
    CHECK_FALSE(sw::optim::save_state(adam, stranger, out));
    REQUIRE(sw::optim::save_state(adam, ps[0], out));
    auto in = reread(out);
    CHECK(error_of([&] { sw::optim::load_state(adam, stranger, *in); }) ==
          "stagewise::optim::load_state: a tensor of shape [5] is not one of the optimizer's "
          "parameters; give the optimizer over the parameters you load into");
  }
}
