// The checkpointed cell alone (core/detail/cell.hpp): what a checkpointed forward runs under, and
// what its recompute replays, without autograd nodes or a pipe around them.

#include "stagewise/core/detail/cell.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "tests/support/autocast.hpp"

#include <doctest/doctest.h>

#include <string>

namespace sw = stagewise;
using sw::detail::RecomputeCasts;

TEST_SUITE("checkpointed cell") {
  TEST_CASE("the forward runs without grad, caching no casts, flagged as checkpointing") {
    bool grad = true, checkpointing = false, recomputing = true, cache = true;
    sw::detail::run_checkpointed(torch::kCPU, [&] {
      grad = torch::GradMode::is_enabled();
      checkpointing = sw::is_checkpointing();
      recomputing = sw::is_recomputing();
      cache = at::autocast::is_autocast_cache_enabled();
    });
    CHECK_FALSE(grad);
    CHECK(checkpointing);
    CHECK_FALSE(recomputing);
    CHECK_FALSE(cache);
    // All back as they were afterwards.
    CHECK(torch::GradMode::is_enabled());
    CHECK_FALSE(sw::is_checkpointing());
    CHECK(at::autocast::is_autocast_cache_enabled());
  }

  TEST_CASE("the recompute draws the forward's random numbers and leaves the generator as it was") {
    torch::manual_seed(5);
    torch::Tensor first, again;
    const auto replay =
        sw::detail::run_checkpointed(torch::kCPU, [&] { first = torch::rand({8}); });
    const auto after_forward = torch::rand({8});  // others draw between forward and recompute
    auto before_recompute = sw::RngState::capture(torch::kCPU);
    bool grad = false, recomputing = false;
    sw::detail::run_recompute(replay, /*replay_rng=*/true, RecomputeCasts::drop, [&] {
      again = torch::rand({8});
      grad = torch::GradMode::is_enabled();
      recomputing = sw::is_recomputing();
    });
    CHECK(torch::equal(first, again));
    CHECK_FALSE(torch::equal(first, after_forward));
    CHECK(grad);
    CHECK(recomputing);
    CHECK_FALSE(sw::is_recomputing());
    CHECK(sw::RngState::capture(torch::kCPU).same_as(before_recompute));
  }

  TEST_CASE("without replay (a stage that draws nothing) the generators are not touched") {
    torch::manual_seed(6);
    const auto replay = sw::detail::run_checkpointed(torch::kCPU, [] {});
    (void)torch::rand({4});  // another stage draws meanwhile
    auto now = sw::RngState::capture(torch::kCPU);
    torch::Tensor drawn;
    sw::detail::run_recompute(replay, /*replay_rng=*/false, RecomputeCasts::drop,
                              [&] { drawn = torch::rand({4}); });
    // It drew from where the generator stood, not from the forward's state.
    sw::RngState::Restore at_now(now);
    CHECK(torch::equal(drawn, torch::rand({4})));
  }

  TEST_CASE("the recompute runs under the forward's autocast, even after the region is left") {
    stagewise::testing::set_cpu_autocast(true);
    const auto replay = sw::detail::run_checkpointed(torch::kCPU, [] {});
    stagewise::testing::set_cpu_autocast(false);
    at::autocast::clear_cache();
    auto w = torch::randn({4, 4}, torch::requires_grad());
    torch::Tensor y;
    bool on = false;
    sw::detail::run_recompute(replay, true, RecomputeCasts::keep, [&] {
      on = stagewise::testing::cpu_autocast_enabled();
      y = torch::mm(w, w);
    });
    CHECK(on);
    CHECK((y.scalar_type() == torch::kBFloat16));
    CHECK_FALSE(stagewise::testing::cpu_autocast_enabled());
  }

  TEST_CASE("a dropping recompute clears the casts it cached; a keeping one leaves them") {
    stagewise::testing::set_cpu_autocast(true);
    const auto replay = sw::detail::run_checkpointed(torch::kCPU, [] {});
    auto w = torch::randn({4, 4}, torch::requires_grad());  // a leaf: its casts are cached
    auto x = torch::randn({4, 4});
    torch::Tensor kept_a, kept_b, dropped_a, dropped_b;
    sw::detail::run_recompute(replay, true, RecomputeCasts::keep,
                              [&] { kept_a = torch::mm(x, w); });
    // Within the region, a second use reuses the cached cast: both results hang off one cast node.
    kept_b = torch::mm(x, w);
    auto cast_of = [](const torch::Tensor& y) {
      for (const auto& e : y.grad_fn()->next_edges()) {
        if (e.function && e.function->next_edges().size() == 1 &&
            e.function->next_edges()[0].function &&
            e.function->next_edges()[0].function->name().find("AccumulateGrad") !=
                std::string::npos) {
          return e.function.get();
        }
      }
      return static_cast<torch::autograd::Node*>(nullptr);
    };
    CHECK((cast_of(kept_a) != nullptr));
    CHECK((cast_of(kept_a) == cast_of(kept_b)));
    at::autocast::clear_cache();
    sw::detail::run_recompute(replay, true, RecomputeCasts::drop,
                              [&] { dropped_a = torch::mm(x, w); });
    dropped_b = torch::mm(x, w);
    CHECK((cast_of(dropped_a) != nullptr));
    CHECK((cast_of(dropped_a) != cast_of(dropped_b)));
    stagewise::testing::set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
}
