// PipeOptions().memory_budget: a pipe built from a Sequential plans its checkpoint mode and
// offloads from profiled sizes, prints the plan, trains as the same pipe configured by hand, and
// refuses a budget nothing fits at construction.
#include "stagewise/pipe.hpp"
#include "stagewise/plan/memory_profile.hpp"
#include "stagewise/runtime/host_store.hpp"
#include "stagewise/schedule/gpipe.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::nn::Sequential model() {
  return torch::nn::Sequential(
      torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32), torch::nn::Tanh(),
      torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4), torch::nn::Tanh());
}

const sw::balance b{2, 2, 2, 2};

// Four stages of two Linear(256, 256) and Tanh: a cell's tensors are 16 KiB for 16 rows, more
// than a checkpointed cell's replay state.
torch::nn::Sequential wide_model() {
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(8, 256));
  m->push_back(torch::nn::Tanh());
  for (int i = 0; i < 6; ++i) {
    m->push_back(torch::nn::Linear(256, 256));
    m->push_back(torch::nn::Tanh());
  }
  m->push_back(torch::nn::Linear(256, 4));
  m->push_back(torch::nn::Tanh());
  return m;
}
const sw::balance wide{4, 4, 4, 4};
const sched::any_schedule gpipe("gpipe", sched::gpipe{});

}  // namespace

TEST_SUITE("memory budget") {
  TEST_CASE("profile_stage_memory: each stage's activations and its input's bytes") {
    const auto m = sw::profile_stage_memory(model(), b, torch::randn({16, 8}));
    REQUIRE(m.size() == 4);
    CHECK(m[0].kept == doctest::Approx(16 * 8 * 4));  // one 16 x 8 float input
    for (std::size_t j = 1; j < 4; ++j) CHECK(m[j].kept == doctest::Approx(16 * 32 * 4));
    for (const auto& s : m) CHECK(s.activations > 0);
  }

  TEST_CASE("the pipe takes the plan's mode, prints it, and trains like the pipe set by hand") {
    const auto sample = torch::randn({16, 8});
    // A loose budget checkpoints nothing; the smallest GPipe fits (named by the refusal of a
    // budget of 1 byte) only fits by offloading. In one process a checkpointed cell's inputs
    // are the previous stage's output, counted on the worker that made it: offloading them
    // frees that worker's bytes (its own cell, checkpointed, keeps none of them).
    auto loose =
        sw::Pipe(wide_model(), wide,
                 sw::PipeOptions().chunks(8).memory_budget(1LL << 30, sample, std::nullopt, gpipe));
    for (auto mode : loose->memory_plan().checkpoints) CHECK(mode == sw::Checkpoint::never);
    const auto smallest_error = error_of([&] {
      (void)sw::Pipe(
          wide_model(), wide,
          sw::PipeOptions().chunks(8).memory_budget(1, sample, sw::runtime::HostStore(), gpipe));
    });
    const auto smallest = std::stoll(smallest_error.substr(smallest_error.find("fits is ") + 8));
    torch::manual_seed(2);
    auto planned_model = wide_model();
    auto planned = sw::Pipe(planned_model, wide,
                            sw::PipeOptions().chunks(8).memory_budget(
                                smallest, sample, sw::runtime::HostStore(), gpipe));
    const auto& plan = planned->memory_plan();
    CHECK(plan.offload);
    for (std::size_t j = 0; j < 4; ++j) {
      CHECK(planned->resolved_options().checkpoints[j] == plan.checkpoints[j]);
    }
    CHECK(planned->resolved_options().offload_store.has_value());
    CHECK(planned->resolved_options().offload_costs.stages == plan.offload_stages);
    CHECK_FALSE(planned->options().offload_store().has_value());  // the user's, as given
    CHECK(contains(plan.to_string(), "memory plan for gpipe, 8 micro-batches, budget " +
                                         std::to_string(smallest) + " bytes per stage"));
    // The same pipe by hand.
    torch::manual_seed(2);
    auto hand_model = wide_model();
    auto hand =
        sw::Pipe(hand_model, wide, sw::PipeOptions().chunks(8).checkpoint(plan.checkpoints));
    const auto x = torch::randn({128, 8});
    const auto t = torch::randn({128, 4});
    auto loss = [](const torch::Tensor& y, const torch::Tensor& z) {
      return torch::mse_loss(y, z);
    };
    sched::Timeline timeline;
    torch::manual_seed(6);
    const auto a = planned->train_step(x, t, loss, sched::gpipe{}, &timeline);
    torch::manual_seed(6);
    const auto c = hand->train_step(x, t, loss, sched::gpipe{});
    CHECK(a.item<float>() == c.item<float>());
    int offloads = 0;
    for (const auto& e : timeline.actions) offloads += e.action.kind == sched::ActionKind::offload;
    CHECK(offloads == static_cast<int>(plan.offloaded.size()));
    const auto pp = planned_model->parameters();
    const auto hp = hand_model->parameters();
    for (std::size_t k = 0; k < pp.size(); ++k) CHECK(pp[k].grad().equal(hp[k].grad()));
  }

  TEST_CASE("a budget nothing fits is refused at construction, naming the smallest that fits") {
    const auto e = error_of([] {
      (void)sw::Pipe(model(), b,
                     sw::PipeOptions().chunks(8).memory_budget(1000, torch::randn({16, 8})));
    });
    CHECK(contains(e,
                   "stagewise::PipeOptions().memory_budget: no plan of one_f_one_b with 8 "
                   "micro-batches fits 1000 bytes of activations per stage; the smallest "
                   "budget that fits is "));
    CHECK(contains(e,
                   " bytes. Give at least that, or more micro-batches (smaller ones), or a "
                   "store to offload to"));
    CHECK(contains(error_of([] {
                     sw::PipeOptions().memory_budget(0, torch::randn({1, 1}));
                   }),
                   "stagewise::PipeOptions: memory_budget is 0 bytes; give a positive number"));
  }

  TEST_CASE("memory_plan without a budget says how to get one") {
    auto pipe = sw::Pipe(model(), b, sw::PipeOptions().chunks(2));
    CHECK(contains(error_of([&] { (void)pipe->memory_plan(); }),
                   "stagewise::Pipe::memory_plan: the pipe has no memory budget; build it from a "
                   "Sequential with PipeOptions().memory_budget(bytes, sample)"));
  }
}
