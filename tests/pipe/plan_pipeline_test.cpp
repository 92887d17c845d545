// plan_pipeline: one call from a model, a batch and a cap per worker to the fastest pipeline that
// fits; sw::Pipe(model, plan) builds exactly that pipe and its train_step runs the planned
// schedule; a cap nothing fits is refused naming the smallest that would; bad options are named.
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace sched = stagewise::schedule;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

torch::nn::Sequential mlp() {
  torch::manual_seed(1);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(32, 32));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }

// A quick question: 2 workers, two schedules, 2 or 4 micro-batches, one profiling round.
sw::PlanOptions quick(std::int64_t cap) {
  return sw::PlanOptions().workers(2).memory_per_worker(cap).rounds(1).micro_batches({2, 4})
      .schedules({"one_f_one_b", "zero_bubble_h1"});
}

}  // namespace

TEST_SUITE("plan_pipeline") {
  TEST_CASE("the plan fits, says what it chose, and Pipe(model, plan) runs exactly it") {
    auto model = mlp();
    const auto x = torch::randn({16, 32}), y = torch::randn({16, 32});
    const auto plan = sw::plan_pipeline(model, sw::Batch(x), quick(64LL << 20));
    REQUIRE(plan.split.size() == 2);
    CHECK(plan.checkpoints.size() == 2);
    CHECK(plan.peak() <= 64.0 * (1 << 20));
    CHECK((plan.micro_batches == 2 || plan.micro_batches == 4));
    const auto report = plan.report();
    CHECK(contains(report, "pipeline plan: " + plan.schedule.name() + " on 2 workers"));
    CHECK(contains(report, "worker 1: peak "));
    CHECK(contains(report, " = parameters "));
    CHECK(contains(report, "candidates ("));
    // The pipe the plan builds runs the planned schedule when train_step is given none.
    auto pipe = sw::Pipe(model, plan);
    sched::Timeline t;
    pipe->train_step(x, y, mse, &t);
    std::vector<int> stops;
    for (auto mode : plan.checkpoints) {
      stops.push_back(static_cast<int>(sw::checkpoint_stop(mode, plan.micro_batches, true)));
    }
    const auto want = sched::plan(plan.schedule, 2, static_cast<int>(plan.micro_batches), stops);
    std::map<std::string, int> ran, planned;
    for (const auto& e : t.actions) ++ran[sched::to_string(e.action)];
    for (const auto& program : want.programs) {
      for (const auto& a : program) ++planned[sched::to_string(a)];
    }
    CHECK(ran == planned);
    // And its gradients are those of the same pipe set by hand.
    const auto grads = [&] {
      std::vector<torch::Tensor> g;
      for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
      return g;
    }();
    auto copy = mlp();
    auto hand = sw::Pipe(copy, plan.split,
                         sw::PipeOptions().chunks(plan.micro_batches).checkpoint(plan.checkpoints));
    hand->train_step(x, y, mse, plan.schedule);
    const auto copied = copy->parameters();
    for (std::size_t k = 0; k < grads.size(); ++k) CHECK(grads[k].equal(copied[k].grad()));
  }

  TEST_CASE("planning for memory takes the smallest peak that fits") {
    auto model = mlp();
    const auto x = torch::randn({16, 32});
    const auto plan = sw::plan_pipeline(model, sw::Batch(x),
                                        quick(64LL << 20).prefer(sw::PlanFor::memory));
    for (const auto& c : plan.candidates) {
      if (c.fits) CHECK(plan.peak() <= c.peak);
    }
  }

  TEST_CASE("a cap nothing fits is refused, naming the smallest cap that would and what helps") {
    auto model = mlp();
    const auto x = torch::randn({16, 32});
    const auto e = error_of([&] { (void)sw::plan_pipeline(model, sw::Batch(x), quick(1000)); });
    CHECK(contains(e, "stagewise::plan_pipeline: nothing fits "));
    CHECK(contains(e, " per worker on 2 workers (headroom 0.05 included); the smallest cap any "
                      "candidate fits is "));
    CHECK(contains(e, "Give at least that, or a store to offload to (PlanOptions().store(...)), "
                      "more workers, or a smaller batch"));
    const auto smallest = std::stoll(e.substr(e.find("fits is ") + 8));
    const auto plan = sw::plan_pipeline(model, sw::Batch(x), quick(smallest));
    CHECK(plan.peak() <= static_cast<double>(smallest));
  }

  TEST_CASE("bad options and bad batches are named") {
    auto model = mlp();
    const auto x = torch::randn({16, 32});
    CHECK(contains(error_of([] { sw::PlanOptions().workers(0); }),
                   "stagewise::PlanOptions: workers is 0; give 1 or more"));
    CHECK(contains(error_of([] { sw::PlanOptions().memory_per_worker(0); }),
                   "stagewise::PlanOptions: memory_per_worker is 0 bytes"));
    CHECK(contains(error_of([&] {
                     (void)sw::plan_pipeline(model, sw::Batch(x), sw::PlanOptions().workers(2));
                   }),
                   "give the bytes each worker may hold: PlanOptions().memory_per_worker(bytes)"));
    CHECK(contains(error_of([&] {
                     (void)sw::plan_pipeline(model, sw::Batch(x),
                                             quick(1 << 30).micro_batches({3}));
                   }),
                   "the batch has 16 rows, which do not split into 3 equal micro-batches"));
    CHECK(contains(error_of([&] {
                     (void)sw::plan_pipeline(model, sw::Batch(x),
                                             quick(1 << 30).schedules({"nope"}));
                   }),
                   "stagewise::PlanOptions: no built-in schedule is named 'nope'; give some of: "));
    CHECK(contains(error_of([&] {
                     (void)sw::plan_pipeline(model, sw::Batch(x), quick(1 << 30).workers(16));
                   }),
                   "no candidate could be planned for 16 workers"));
  }
}
