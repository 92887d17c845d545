// plan_pipeline with PlanOptions().ranks(N): every factorisation N = K x d weighed (with the
// sharding of the replicas' state), the replicas' gradient exchange costed from the link: a slow
// link chooses the deepest pipeline, a free one replicas; the report lists the factorisations;
// refusals named (no link with replicas, ranks with replicas, a one-process Pipe given a plan
// for ranks); a d that does not divide the rows is skipped with its reason.
#include "stagewise/stagewise.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace {

// 8 x [Linear(256, 256), Tanh]: on 64 rows its arithmetic, not its calls, takes the time.
torch::nn::Sequential ranks_mlp() {
  torch::manual_seed(2);
  torch::nn::Sequential m;
  for (int i = 0; i < 8; ++i) {
    m->push_back(torch::nn::Linear(256, 256));
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor ranks_mse(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::mse_loss(a, b);
}

// One plan on `cache`'s profiles (profiled on the first call): plans compared across links see
// the same costs, so what differs is the link's alone (two profiles differ by far more than an
// exchange on a loaded machine).
sw::PipelinePlan plan_on(sw::detail::ProfileCache& cache, const torch::nn::Sequential& model,
                         const torch::Tensor& x, const torch::Tensor& y,
                         const sw::PlanOptions& options) {
  return sw::detail::plan_for_ranks(model, sw::Batch(x), y,
                                    y.defined() ? sw::runtime::loss_fn_t(ranks_mse) : nullptr,
                                    options, &cache);
}

sw::PlanOptions for_ranks(int n) {
  return sw::PlanOptions()
      .ranks(n)
      .memory_per_worker(256 << 20)
      .rounds(1)
      .micro_batches({1, 2, 4})
      .schedules({"gpipe", "one_f_one_b"});
}

}  // namespace

TEST_SUITE("plan_pipeline for ranks") {
  TEST_CASE("a slow link chooses the deepest pipeline, a free one replicas") {
    auto model = ranks_mlp();
    const auto x = torch::randn({64, 256}), y = torch::randn({64, 256});
    sw::detail::ProfileCache cache;
    // 10 ms a message and 1 MB/s: an exchange of a stage's gradients costs far more than a step.
    const auto slow = plan_on(
        cache, model, x, y,
        for_ranks(4).link(sw::LinkSpeed{.latency_seconds = 10e-3, .bytes_per_second = 1e6}));
    CHECK(slow.ranks == 4);
    CHECK(slow.workers == 4);
    CHECK(slow.replicas == 1);
    CHECK(slow.split.size() == 4);
    // A free link: replicas (1 x 4 or 2 x 2, whichever the profile makes faster), each on its
    // share of the rows.
    const auto free = plan_on(cache, model, x, y, for_ranks(4).link(sw::LinkSpeed{}));
    CHECK(free.replicas > 1);
    CHECK(free.workers * free.replicas == 4);
    CHECK(free.batch_rows == 64 / free.replicas);  // a replica's rows
    const std::string shape = std::to_string(free.workers) + " x " + std::to_string(free.replicas);
    // Every factorisation weighed: 4 x 1, and 2 x 2 and 1 x 4 with three shardings each.
    CHECK(free.factorisations.size() == 7);
    const auto report = free.report();
    INFO(report);
    CHECK(contains(report, "ranks plan: 4 ranks as " + shape + " ("));
    CHECK(contains(report, "factorisations (7):"));
    CHECK(contains(report, "chosen " + shape));
    // The chosen factorisation is the fastest that fits.
    for (const auto& f : free.factorisations) {
      if (f.fits) CHECK(free.step_seconds <= f.step_seconds * (1 + 1e-9));
    }
    CHECK(contains(report, "4 x 1, sharding none: step"));
    CHECK(contains(report, "2 x 2, sharding optimizer state and gradients: step"));
    // Each candidate names its factorisation and is a plan for the ranks.
    REQUIRE(!free.candidates.empty());
    CHECK(contains(free.candidates.front().description, " x "));
    REQUIRE(free.candidates.front().plan);
    CHECK(free.candidates.front().plan->ranks == 4);
  }

  TEST_CASE("the exchange is costed: a slower link never predicts a faster step") {
    auto model = ranks_mlp();
    const auto x = torch::randn({64, 256});
    auto opts = for_ranks(2).schedules({"gpipe"}).micro_batches({2}).fused_step(false);
    sw::detail::ProfileCache cache;  // both on one profile: they differ by the link alone
    const auto fast = plan_on(cache, model, x, torch::Tensor(), opts.link(sw::LinkSpeed{}));
    const auto slow =
        plan_on(cache, model, x, torch::Tensor(),
                opts.link(sw::LinkSpeed{.latency_seconds = 5e-3, .bytes_per_second = 1e8}));
    // The same factorisation (1 x 2 unsharded) costs more over the slow link by its all-reduce:
    // 8 layers' 2.1 MB of gradients in one bucket, 2 ranks: 2 x (5 ms + 1.05 MB at 100 MB/s) =
    // 31 ms (within 15%: the exchange's buckets are costed as the reducer fills them).
    double f = 0, s = 0;
    for (const auto& p : fast.factorisations) {
      if (p.stage_ranks == 1 && p.sharding == "none") f = p.step_seconds;
    }
    for (const auto& p : slow.factorisations) {
      if (p.stage_ranks == 1 && p.sharding == "none") s = p.step_seconds;
    }
    REQUIRE(f > 0);
    const double exchange = 2 * (5e-3 + 8 * (256 * 256 + 256) * 4 / 2.0 / 1e8);
    CHECK(s - f == doctest::Approx(exchange).epsilon(0.15));
  }

  TEST_CASE("refusals: no link with replicas, ranks with replicas, a one-process Pipe") {
    auto model = ranks_mlp();
    const auto x = torch::randn({64, 256});
    CHECK(error_of([&] { (void)sw::plan_pipeline(model, sw::Batch(x), for_ranks(4)); }) ==
          "stagewise::plan_pipeline: ranks(4) weighs replicas (2 x 2, 1 x 4 ranks per pipeline x "
          "replicas), whose gradient exchange is costed from the link's speed, and none was "
          "given: give PlanOptions().link(sw::LinkSpeed{...}), or measure the job's with "
          "sw::distributed::measure_link(job)");
    CHECK(error_of([&] {
            (void)sw::plan_pipeline(model, sw::Batch(x),
                                    for_ranks(4).replicas(2).link(sw::LinkSpeed{}));
          }) ==
          "stagewise::plan_pipeline: ranks(4) weighs the replicas and their sharding "
          "itself; leave out replicas(2) and the sharding setters, or plan one replica "
          "with workers(K).replicas(d)");
    CHECK(error_of([] { sw::PlanOptions().ranks(0); }) ==
          "stagewise::PlanOptions: ranks is 0; give the job's ranks (1 or more)");
    CHECK(error_of([] { sw::PlanOptions().link(sw::LinkSpeed{.latency_seconds = 0, .bytes_per_second = 0}); }) ==
          "stagewise::PlanOptions::link: the link's speed is 0 bytes per second; give a positive "
          "speed (e.g. 10e9), or measure it with distributed::measure_link");
    const auto plan = sw::plan_pipeline(model, sw::Batch(x), for_ranks(2).link(sw::LinkSpeed{}));
    CHECK(error_of([&] { (void)sw::Pipe(model, plan); }) ==
          "stagewise::Pipe: the plan is for a job of 2 ranks (" + std::to_string(plan.workers) +
              " per pipeline x " + std::to_string(plan.replicas) +
              " replicas); build it on every rank with sw::distributed::Pipe(model, plan), or "
              "plan one process with PlanOptions().workers(K)");
    // One rank: no link needed, one stage on one rank.
    const auto one = sw::plan_pipeline(model, sw::Batch(x), for_ranks(1));
    CHECK(one.workers == 1);
    CHECK(one.replicas == 1);
    CHECK(one.factorisations.size() == 1);
  }

  TEST_CASE("a replica count that does not divide the rows is skipped, with its reason") {
    auto model = ranks_mlp();
    const auto x = torch::randn({6, 256});
    const auto plan = sw::plan_pipeline(model, sw::Batch(x),
                                        sw::PlanOptions()
                                            .ranks(4)
                                            .memory_per_worker(256 << 20)
                                            .rounds(1)
                                            .micro_batches({1})
                                            .schedules({"gpipe"})
                                            .link(sw::LinkSpeed{}));
    CHECK(plan.replicas != 4);
    const auto report = plan.report();
    INFO(report);
    CHECK(contains(report,
                   "1 x 4, sharding none - not weighed: the batch's 6 rows do not split "
                   "into 4 replicas"));
  }
}
