#include "stagewise/pipe/distributed/measure_link.hpp"
#include "stagewise/plan/link_speed.hpp"
#include "stagewise/runtime/c10d/group.hpp"

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace rt = stagewise::runtime;
using stagewise::testing::error_of;
using stagewise::testing::run_ranks;
using namespace std::chrono_literals;

TEST_SUITE("link speed") {
  TEST_CASE("collectives are costed as rings: 2(n-1) steps for an all-reduce, n-1 otherwise") {
    const sw::LinkSpeed link{.latency_seconds = 1e-4, .bytes_per_second = 1e9};
    // 4 ranks, 4e8 bytes: each step sends 1e8 bytes (0.1 s) after 1e-4 s.
    CHECK(link.all_reduce_seconds(4e8, 4) == doctest::Approx(6 * (1e-4 + 0.1)));
    CHECK(link.reduce_scatter_seconds(4e8, 4) == doctest::Approx(3 * (1e-4 + 0.1)));
    CHECK(link.all_gather_seconds(4e8, 4) == doctest::Approx(3 * (1e-4 + 0.1)));
    CHECK(link.all_reduce_seconds(4e8, 1) == 0.0);
    CHECK(sw::LinkSpeed{}.all_reduce_seconds(1e12, 8) == 0.0);
    CHECK(sw::LinkSpeed{}.to_string() == "free");
    CHECK(link.to_string() == "100 us + 1 GB/s");
  }

  TEST_CASE("a speed no link has is refused, naming the fix") {
    CHECK(error_of([] { sw::LinkSpeed{.latency_seconds = -1}.check("who"); }) ==
          "who: the link's latency is -1 seconds; give 0 or more (e.g. 30e-6), or measure it "
          "with distributed::measure_link");
    CHECK(error_of([] { sw::LinkSpeed{.bytes_per_second = 0}.check("who"); }) ==
          "who: the link's speed is 0 bytes per second; give a positive speed (e.g. 10e9), or "
          "measure it with distributed::measure_link");
  }

  TEST_CASE("the fitted line is a least-squares one, and stays positive under noise") {
    const auto [a, b] = sw::distributed::detail::fit_line({1, 2, 3}, {3, 5, 7});
    CHECK(a == doctest::Approx(1));
    CHECK(b == doctest::Approx(2));
    // Times that fall with size (noise): no negative cost per byte.
    const auto [a2, b2] = sw::distributed::detail::fit_line({1, 2}, {5, 1});
    CHECK(a2 == 0.0);
    CHECK(b2 > 0.0);
  }

  TEST_CASE("measure_link over 2 ranks: every rank gets the same finite, positive speed") {
    auto r = run_ranks(
        2,
        [](int) {
          auto job = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{20s});
          const auto link = sw::distributed::measure_link(
              job, {.bytes = {4 << 10, 1 << 20}, .rounds = 3});
          std::ostringstream s;
          s.precision(17);
          s << link.latency_seconds << " " << link.bytes_per_second;
          stagewise::testing::report(s.str());
        },
        60s);
    REQUIRE(r.size() == 2);
    CHECK(r[0].status == 0);
    CHECK(r[1].status == 0);
    CHECK(r[0].text == r[1].text);  // the ranks' averaged times: one speed for the job
    std::istringstream in(r[0].text);
    double latency = -1, speed = -1;
    in >> latency >> speed;
    CHECK(latency >= 0.0);
    CHECK(speed > 1e6);  // loopback moves more than a MB a second
    CHECK(std::isfinite(speed));
  }

  TEST_CASE("measure_link on one rank: no link, a free one") {
    auto r = run_ranks(
        1,
        [](int) {
          auto job = rt::connect(rt::rendezvous_env(), rt::ConnectOptions{20s});
          stagewise::testing::report(sw::distributed::measure_link(job).to_string());
        },
        60s);
    CHECK(r[0].status == 0);
    CHECK(r[0].text == "free");
  }
}
