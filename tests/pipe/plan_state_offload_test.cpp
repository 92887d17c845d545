// plan_pipeline with PlanOptions().optimizer_store: each candidate is weighed with none, half or
// all of each stage's optimizer state off the device; the smallest cap that fits falls by the
// state's bytes; the report shows what each worker keeps off the device and moves per step; and
// the pipe the plan builds keeps it there, training as the same pipe without it.
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// Parameters dominate: 4 x Linear(128, 128) on 8 rows.
torch::nn::Sequential mlp() {
  torch::manual_seed(1);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(128, 128));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::mse_loss(a, b);
}

sw::PlanOptions quick() {
  return sw::PlanOptions()
      .workers(2)
      .rounds(1)
      .micro_batches({2})
      .schedules({"one_f_one_b"})
      .fused_step(true);
}

// The smallest cap the planner names when it refuses a cap of 1 byte.
std::int64_t smallest_cap(const torch::nn::Sequential& model, const torch::Tensor& x,
                          sw::PlanOptions options) {
  const auto e =
      error_of([&] { (void)sw::plan_pipeline(model, sw::Batch(x), options.memory_per_worker(1)); });
  const std::string key = "the smallest cap any candidate fits is ";
  REQUIRE(contains(e, key));
  return std::stoll(e.substr(e.find(key) + key.size()));
}

}  // namespace

TEST_SUITE("plan_pipeline with the optimizer's state off the device") {
  TEST_CASE("the smallest cap falls by the state's bytes, and the report says what moves") {
    auto model = mlp();
    const auto x = torch::randn({8, 128}), y = torch::randn({8, 128});
    const auto on_device = smallest_cap(model, x, quick());
    const auto off = smallest_cap(model, x, quick().optimizer_store(sw::runtime::HostStore()));
    // A worker holds at least one of the 4 layers: 66048 bytes of parameters, and Adam's state
    // twice that, which all goes.
    MESSAGE("smallest cap on the device " << on_device << ", with the state off " << off);
    CHECK(on_device - off >= 2 * 66048);
    const auto plan = sw::plan_pipeline(
        model, sw::Batch(x), y, mse,
        quick().optimizer_store(sw::runtime::HostStore()).memory_per_worker(off + 16));
    REQUIRE(plan.optimizer_shares == std::vector<double>{1.0, 1.0});
    CHECK(plan.optimizer_store.has_value());
    const auto report = plan.report();
    CHECK(contains(report, "stage 0: checkpoint "));
    CHECK(contains(report, ", optimizer state all off the device\n"));
    CHECK(contains(report, "; optimizer state off the device "));
    CHECK(contains(report, " per step\n"));
    CHECK(contains(report, ", optimizer state off the device: all | all"));
    // Per worker (one stage each): Adam's state (twice the parameters) off the device; moved per
    // step: each parameter's gradient and value out and the value back, the state out and in.
    std::size_t first = 0;
    const auto layers = model->children();
    for (std::size_t w = 0; w < plan.memory.size(); ++w) {
      double params = 0;
      for (std::size_t l = first; l < first + static_cast<std::size_t>(plan.split[w]); ++l) {
        for (const auto& p : layers[l]->parameters()) params += static_cast<double>(p.nbytes());
      }
      first += static_cast<std::size_t>(plan.split[w]);
      CAPTURE(w);
      CHECK(plan.memory[w].optimizer == 0.0);
      CHECK(plan.memory[w].optimizer_offloaded == 2 * params);
      CHECK(plan.memory[w].moved == 3 * params + 2 * 2 * params);
    }
    // The pipe the plan builds keeps it there, and trains as the pipe without it.
    auto pipe = sw::Pipe(model, plan);
    REQUIRE(pipe->resolved_options().optimizer_store.has_value());
    CHECK(pipe->resolved_options().optimizer_shares == std::vector<double>{1.0, 1.0});
    sw::optim::FusedStep fused(pipe->named_parameters(), torch::optim::AdamOptions(1e-3));
    auto copy = mlp();
    auto plain = sw::Pipe(copy, plan.split,
                          sw::PipeOptions()
                              .chunks(plan.micro_batches)
                              .checkpoint(plan.checkpoints)
                              .schedule(plan.schedule));
    sw::optim::FusedStep plain_fused(plain->named_parameters(), torch::optim::AdamOptions(1e-3));
    for (int step = 0; step < 2; ++step) {
      pipe->train_step(x, y, mse, fused);
      plain->train_step(x, y, mse, plain_fused);
    }
    for (std::size_t i = 0; i < fused.size(); ++i) CHECK(fused.offloaded(i));
    for (std::size_t k = 0; k < model->parameters().size(); ++k) {
      CHECK(torch::equal(model->parameters()[k], copy->parameters()[k]));
    }
  }

  TEST_CASE("at a cap that fits on the device, no state moves") {
    auto model = mlp();
    const auto x = torch::randn({8, 128});
    const auto plan = sw::plan_pipeline(
        model, sw::Batch(x),
        quick().optimizer_store(sw::runtime::HostStore()).memory_per_worker(64LL << 20));
    // None fits first and is the fastest (a host step copies on top), or is as fast.
    CHECK(plan.candidates.size() >= 3);  // none, half, all
    bool none_weighed = false;
    for (const auto& c : plan.candidates) {
      none_weighed =
          none_weighed || contains(c.description, "optimizer state off the device: none | none");
    }
    CHECK(none_weighed);
    CHECK(contains(
        error_of([] { (void)sw::PlanOptions().optimizer_store(sw::runtime::HostStore(), 0); }),
        "the optimizer store's speed is 0 bytes per second; give a positive speed"));
  }
}
