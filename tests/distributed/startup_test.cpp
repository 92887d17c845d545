#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/c10d/group.hpp"

#include <torch/nn/modules/linear.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

namespace rt = stagewise::runtime;
using stagewise::testing::error_of;
using stagewise::testing::run_ranks;
using namespace std::chrono_literals;

TEST_SUITE("distributed start-up checks") {
  TEST_CASE("a stage signature lists parameter names, dtypes and shapes") {
    torch::nn::Linear l(4, 8);
    CHECK(rt::stage_signature(*l) == "weight Float [8, 4]; bias Float [8]");
  }

  TEST_CASE("ranks that built different stages all fail with the same message before any step") {
    auto r = run_ranks(
        3,
        [](int rank) {
          auto c = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{10s});
          torch::nn::Linear s0(4, 8), s1(8, rank == 2 ? 3 : 2);
          stagewise::testing::report(error_of([&] {
            rt::check_same_model(c, {rt::stage_signature(*s0), rt::stage_signature(*s1)});
          }));
        },
        60s);
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            "stagewise::distributed: ranks 0 and 2 built different stage 1: rank 0 has {weight "
            "Float [2, 8]; bias Float [2]}, rank 2 has {weight Float [3, 8]; bias Float [3]}; "
            "every rank must build the same model and balance");
    }
  }

  TEST_CASE("ranks that built the same model pass, and a wrong world size is named") {
    auto r = run_ranks(
        2,
        [](int) {
          auto c = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{10s});
          torch::nn::Linear s0(4, 8), s1(8, 2);
          rt::check_same_model(c, {rt::stage_signature(*s0), rt::stage_signature(*s1)});
          rt::check_world_size(c, 2, 2);
          stagewise::testing::report(error_of([&] { rt::check_world_size(c, 4, 4); }));
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            "stagewise::distributed: the pipe has 4 stages on 4 workers, one per rank, but "
            "WORLD_SIZE is 2; start 4 ranks (tools/launch -n 4), or change the balance or the "
            "schedule's virtual stages to fit 2 ranks");
    }
  }
}
