// What a data-parallel replica holds of a stage (schedule::replica_state), and worker_memory's
// peaks with it: unsharded replicas add the reduction's bucket copies of the gradients; sharded
// optimizer state (ZeRO-1) keeps 1/d of the state (at most, plus the largest tensor); sharded
// gradients (ZeRO-2) keep 1/d of the gradients plus what is in flight.

#include "stagewise/plan/worker_memory.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/plan.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

namespace sched = stagewise::schedule;
using stagewise::testing::error_of;

namespace {

// A stage of 32 equal parameters of 1 MiB each, Adam (two moments), its temporaries two tensors.
constexpr double kMiB = 1 << 20;
const sched::StageState kWhole{
    .params = 32 * kMiB, .grads = 32 * kMiB, .optimizer = 64 * kMiB, .step_working = 2 * kMiB};

}  // namespace

TEST_SUITE("replica state") {
  TEST_CASE("one replica holds the stage as it is; unsharded replicas add the bucket copies") {
    const auto one = sched::replica_state(kWhole, {.replicas = 1, .shard_gradients = true});
    CHECK(one.grads == kWhole.grads);
    CHECK(one.optimizer == kWhole.optimizer);
    const auto two = sched::replica_state(kWhole, {.replicas = 2, .largest_tensor = kMiB});
    CHECK(two.params == 32 * kMiB);
    CHECK(two.grads == 64 * kMiB);  // the gradients and their copies in the reducer's buckets
    CHECK(two.optimizer == 64 * kMiB);
    CHECK(two.step_working == 2 * kMiB);
  }

  TEST_CASE("sharded state: 1/d of the optimizer state plus at most the largest tensor's share") {
    const auto s = sched::replica_state(
        kWhole, {.replicas = 2, .shard_optimizer_state = true, .largest_tensor = kMiB});
    // Whole until the reduction, plus a bucket's flat copy (25 MiB, the default) and its owned
    // part's copy of the sum.
    CHECK(s.grads == doctest::Approx(32 * kMiB + 25 * kMiB * (1 + 0.5 + 1.0 / 32)));
    CHECK(s.optimizer == doctest::Approx(64 * kMiB * (0.5 + 1.0 / 32)));  // (1/2 + 1/32) of it
    // One tensor of most of the stage (an embedding): its owner holds nearly all of it.
    const sched::StageState lopsided{
        .params = 32 * kMiB, .grads = 32 * kMiB, .optimizer = 64 * kMiB, .step_working = 60 * kMiB};
    const auto e = sched::replica_state(
        lopsided, {.replicas = 4, .shard_optimizer_state = true, .largest_tensor = 30 * kMiB});
    CHECK(e.optimizer == doctest::Approx(64 * kMiB));  // min(1, 1/4 + 30/32)
  }

  TEST_CASE("sharded gradients: 1/d of them plus two buckets in flight and the one computed") {
    const auto s = sched::replica_state(
        kWhole,
        {.replicas = 2, .shard_gradients = true, .bucket_bytes = kMiB, .largest_tensor = kMiB});
    CHECK(s.grads == doctest::Approx(32 * kMiB * (0.5 + 1.0 / 32) + 3 * kMiB));
    CHECK(s.optimizer == doctest::Approx(64 * kMiB * (0.5 + 1.0 / 32)));
    // Buckets of 25 MiB (the default): the shard plus two buckets and the tensor computed, never
    // more than the sharded optimizer state alone holds.
    const auto big = sched::replica_state(
        kWhole, {.replicas = 2, .shard_gradients = true, .largest_tensor = kMiB});
    CHECK(big.grads == doctest::Approx(32 * kMiB * (0.5 + 1.0 / 32) + 2 * 25 * kMiB + kMiB));
    const auto zero1 = sched::replica_state(
        kWhole, {.replicas = 2, .shard_optimizer_state = true, .largest_tensor = kMiB});
    CHECK(big.grads <= zero1.grads);
    CHECK(error_of([] { sched::replica_state(kWhole, {.replicas = 0}); }) ==
          "stagewise::schedule::replica_state: 0 replicas; give 1 or more");
  }

  TEST_CASE("worker_memory with replica states: sharded gradients < sharded state < unsharded") {
    const auto plan = sched::plan(sched::one_f_one_b{}, 2, 4);
    const std::vector<sched::CellBytes> cells{{.forward = kMiB, .working = kMiB}};
    auto peak = [&](const sched::StageReplicas& r) {
      const auto w = sched::worker_memory(plan, cells, {sched::replica_state(kWhole, r)},
                                          /*fused=*/false);
      return std::max(w[0].peak, w[1].peak);
    };
    const auto plain = peak({.replicas = 2, .largest_tensor = kMiB});
    const auto zero1 = peak({.replicas = 2,
                             .shard_optimizer_state = true,
                             .bucket_bytes = kMiB,
                             .largest_tensor = kMiB});
    const auto zero2 = peak(
        {.replicas = 2, .shard_gradients = true, .bucket_bytes = kMiB, .largest_tensor = kMiB});
    // At the end of the step (the optimizer's, its temporaries too), or in the last backward:
    // parameters 32 MiB; gradients 64 (and copies), 32 + 1 + 17/32 (a bucket's two copies),
    // 32 x 17/32 + 3; state 64, 34, 34.
    CHECK(plain >= (32 + 64 + 64 + 2) * kMiB);
    CHECK(plain <= (32 + 64 + 64 + 4) * kMiB);
    CHECK(zero1 >= (32 + 33.53 + 34 + 2) * kMiB);
    CHECK(zero1 <= (32 + 33.54 + 34 + 4) * kMiB);
    CHECK(zero2 >= (32 + 20 + 34 + 2) * kMiB);
    CHECK(zero2 <= (32 + 20 + 34 + 4) * kMiB);
    // Per fp32 parameter: about 20, 12 and 11 bytes (4 + 12/d, the bound's slack and the
    // buckets in flight).
    const double params = 32 * kMiB / 4;
    CHECK(zero2 / params < 4 + 12.0 / 2 + 1.5);
  }
}
