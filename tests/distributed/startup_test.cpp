#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/pipe/distributed/pipe.hpp"
#include "stagewise/pipe/options.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/options.hpp"

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace rt = stagewise::runtime;
using stagewise::testing::contains;
using stagewise::testing::error_of;
using stagewise::testing::report;
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

TEST_SUITE("wire handshake") {
  TEST_CASE("a rank announces its wire version, inline room, layout, LibTorch, device, dtypes") {
    const auto w = rt::wire_format(rt::C10dOptions());
    CHECK(w.version == 2);
    CHECK(w.inline_bytes == 64 * 1024);
    CHECK(w.libtorch == TORCH_VERSION);
    CHECK(w.device == "cpu");
    CHECK(contains(w.dtypes, "Float=6/4"));
    CHECK(contains(w.dtypes, "BFloat16=15/2"));
    CHECK(rt::wire_format(rt::C10dOptions().device(torch::Device("cuda:1"))).inline_bytes == 0);
    CHECK(rt::wire_format(rt::C10dOptions().device(torch::Device("cuda:1"))).device == "cuda");
  }

  TEST_CASE("ranks with different wire formats all fail at start-up, naming both and each field") {
    auto r = run_ranks(
        3,
        [](int rank) {
          auto c = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{10s});
          auto mine = rt::wire_format(rt::C10dOptions());
          if (rank == 2) {
            mine.inline_bytes = 1024;
            mine.libtorch = "0.0.1";
          }
          report(error_of([&] { rt::check_same_wire(c, mine); }));
        },
        60s);
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            std::string("stagewise::distributed: ranks 0 and 2 speak different wire formats: "
                        "inline room is 65536 bytes on rank 0 but 1024 bytes on rank 2; LibTorch "
                        "is ") +
                TORCH_VERSION +
                " on rank 0 but 0.0.1 on rank 2. Every rank must run the same stagewise and "
                "LibTorch build with the same transport device (Gloo on CPU, or NCCL on GPU), "
                "or they would misread each other's messages");
    }
  }

  TEST_CASE("a pipe whose ranks speak different wire versions fails at construction, naming both") {
    auto r = run_ranks(
        2,
        [](int rank) {
          if (rank == 1) rt::detail::wire_version_for_tests = 3;  // as another build would
          torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
          report(error_of([&] {
            sw::distributed::Pipe pipe(seq, sw::balance{1, 1}, sw::PipeOptions().chunks(2),
                                       sw::distributed::Options().timeout(10s));
          }));
        },
        60s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(r[static_cast<std::size_t>(k)].status == 0);
      CHECK(r[static_cast<std::size_t>(k)].text ==
            "stagewise::distributed: ranks 0 and 1 speak different wire formats: wire version is "
            "2 on rank 0 but 3 on rank 1. Every rank must run the same stagewise and LibTorch "
            "build with the same transport device (Gloo on CPU, or NCCL on GPU), or they would "
            "misread each other's messages");
    }
  }
}
