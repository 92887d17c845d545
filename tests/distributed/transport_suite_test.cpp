// The shared transport tests (tests/support/transport_suite.hpp) over C10dTransport: two ranks in
// two processes over Gloo on loopback, each a `stagewise::PipeOver<runtime::C10dTransport>` (the
// public pipe template over the transport alone, without distributed::Pipe's start-up checks).

#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/subgroup.hpp"
#include "stagewise/runtime/c10d/transport.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/transport_suite.hpp"
#include "tests/support/wire_peer.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace suite = sw::testing::transport_suite;
using namespace std::chrono_literals;

static_assert(sw::runtime::pipe_transport<sw::runtime::C10dTransport>);
static_assert(sw::runtime::value_gathering_transport<sw::runtime::C10dTransport>);

TEST_SUITE("shared transport tests") {
  TEST_CASE("C10dTransport passes them on two ranks in two processes") {
    const auto dir = (std::filesystem::temp_directory_path() /
                      ("stagewise_suite_c10d_" + std::to_string(::getpid())))
                         .string();
    std::filesystem::remove_all(dir);
    const auto r = sw::testing::run_ranks(
        2,
        [&](int) {
          auto c = sw::testing::connected();
          int made = 0;
          auto make = [&](const torch::nn::Sequential& seq, const sw::balance& b,
                          const sw::PipeOptions& o) {
            // A group of its own for each pipe: a failure ends its group's connections.
            const auto name = "suite/" + std::to_string(++made);
            auto t = std::make_unique<sw::runtime::C10dTransport>(
                sw::runtime::subgroup(c, {0, 1}, name), std::vector<int>{0, 1},
                sw::runtime::C10dOptions().timeout(20s).prefix(name));
            return sw::PipeOver<sw::runtime::C10dTransport>(seq, b, o, std::move(t));
          };
          suite::run_all(make, dir);
        },
        120s);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(sw::testing::of(r, k).status == 0);
      CHECK(sw::testing::of(r, k).text == "");
    }
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a transport built without every stage's rank cannot tell a pipe its processes") {
    const auto r = sw::testing::run_ranks(
        1,
        [](int) {
          auto c = sw::testing::connected();
          sw::runtime::C10dTransport t(c, [](int stage) { return stage; });
          sw::testing::report(sw::testing::error_of([&] { t.processes(); }));
        },
        60s);
    CHECK(sw::testing::of(r, 0).text ==
          "stagewise::C10dTransport::processes: this transport was built with a rank_of function, "
          "which does not say how many stages there are; build it with every stage's rank (a "
          "std::vector<int>) to run a pipe over it");
  }
}
