#include "stagewise/schedule/timeline.hpp"
#include "stagewise/schedule/chrome_trace.hpp"
#include "stagewise/schedule/dualpipe_v.hpp"
#include "stagewise/schedule/gpipe.hpp"
#include "stagewise/schedule/interleaved.hpp"
#include "stagewise/schedule/one_f_one_b.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/schedule/svg.hpp"
#include "stagewise/schedule/zero_bubble.hpp"
#include "stagewise/schedule/zero_bubble_v.hpp"

#include "tests/support/errors.hpp"
#include "tests/support/wellformed.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace sched = stagewise::schedule;
using stagewise::testing::balanced_xml;
using stagewise::testing::contains;
using stagewise::testing::count;
using stagewise::testing::error_of;
using stagewise::testing::temp_path;
using stagewise::testing::valid_json;

namespace {
std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

TEST_SUITE("timeline") {
  TEST_CASE("span, busy time and bubble of a small timeline") {
    sched::Timeline t;
    t.workers = 2;
    t.stages = 2;
    t.actions = {{{0, sched::ActionKind::forward, 0}, 0, 10.0, 11.0},
                 {{1, sched::ActionKind::forward, 0}, 1, 11.0, 12.0},
                 {{1, sched::ActionKind::backward, 0}, 1, 12.0, 14.0},
                 {{0, sched::ActionKind::backward, 0}, 0, 14.0, 16.0}};
    CHECK(t.begin() == 10.0);
    CHECK(t.span() == 6.0);
    CHECK(t.busy(0) == 3.0);
    CHECK(t.bubble() == doctest::Approx(0.5));
    CHECK(sched::Timeline{}.bubble() == 0.0);
    CHECK(t.waiting(0) == 0.0);  // none recorded
    t.actions[1].waited = 1.0;
    t.actions[3].waited = 2.0;
    CHECK(t.waiting(1) == 1.0);
    CHECK(t.waiting_share() == doctest::Approx(3.0 / 12.0));
  }

  TEST_CASE("a simulation records each action's wait: 1F1B waits only in fill and drain") {
    auto sim = sched::simulate(sched::one_f_one_b{}, 2, 2);
    // Worker 1 waits 1 for F0; worker 0 waits 2 for B0's gradient and 1 for B1's.
    CHECK(sim.timeline.waiting(1) == 1.0);
    CHECK(sim.timeline.waiting(0) == 3.0);
    CHECK(sim.timeline.waiting_share() == doctest::Approx(4.0 / 18.0));
    // The bubble also counts worker 1's idle time after its last action.
    CHECK(sim.bubble() == doctest::Approx(6.0 / 18.0));
  }
}

TEST_SUITE("svg") {
  TEST_CASE("the picture is well-formed SVG with exactly one box per action") {
    for (int v : {1, 2}) {
      auto sim = v == 1 ? sched::simulate(sched::zero_bubble_h1{}, 4, 8)
                        : sched::simulate(sched::interleaved_one_f_one_b{v}, 4 * v, 8);
      auto svg = sched::to_svg(sim.timeline, {.title = "ZB-H1 <4 stages> & 8 micro-batches"});
      CHECK(svg.rfind("<svg", 0) == 0);
      CHECK(svg.size() >= 7);
      CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
      CHECK(balanced_xml(svg));
      CHECK(count(svg, "<rect") == sim.timeline.actions.size());
      CHECK(contains(svg, "ZB-H1 &lt;4 stages&gt; &amp; 8 micro-batches"));
      CHECK(contains(svg, v == 1 ? ">stage 3<" : ">worker 3<"));
    }
  }

  TEST_CASE("boxes are labelled with micro-batches, coloured by kind, and bubbles are gaps") {
    auto sim = sched::simulate(sched::one_f_one_b{}, 2, 2);
    auto svg = sched::to_svg(sim.timeline);
    CHECK(count(svg, "fill=\"#4c78a8\"") == 4 + 1);  // four forwards and the legend
    CHECK(count(svg, "fill=\"#54a24b\"") == 4 + 1);
    CHECK(contains(svg, "<title>F1@0 1.00-2.00 T</title>"));
    CHECK(contains(svg, "bubble 33.33%"));  // (K-1)/(M+K-1)
    CHECK(sim.bubble() == doctest::Approx(1.0 / 3.0));
  }

  TEST_CASE("write_svg writes the file and names a bad path") {
    auto sim = sched::simulate(sched::gpipe{}, 2, 3);
    const std::string path = temp_path("gpipe.svg");
    sched::write_svg(sim.timeline, path);
    CHECK(read(path) == sched::to_svg(sim.timeline));
    std::remove(path.c_str());
    CHECK(contains(error_of([&] { sched::write_svg(sim.timeline, "/no/such/dir/x.svg"); }),
                   "cannot open '/no/such/dir/x.svg' for writing"));
  }
}

TEST_SUITE("chrome trace") {
  TEST_CASE("the trace is valid JSON with one complete event per action on one track per worker") {
    auto sim = sched::simulate(sched::interleaved_one_f_one_b{2}, 4, 4);
    auto json = sched::to_chrome_trace(sim.timeline, 1000.0);
    CHECK(valid_json(json));
    CHECK(json.rfind("{\"traceEvents\":[", 0) == 0);
    CHECK(count(json, "\"ph\":\"X\"") == sim.timeline.actions.size());
    CHECK(count(json, "\"ph\":\"M\"") == 2);
    CHECK(contains(json,
                   "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":1,\"args\":{\"name\":"
                   "\"worker 1\"}}"));
    CHECK(contains(
        json,
        "{\"name\":\"F0\",\"cat\":\"forward\",\"ph\":\"X\",\"pid\":0,\"tid\":0,\"ts\":0.000,"
        "\"dur\":1000.000,\"args\":{\"stage\":0,\"micro\":0}}"));
    CHECK_FALSE(valid_json(json.substr(0, json.size() - 3)));
  }

  TEST_CASE("V-shaped schedules draw two stages per worker track, the way up paler") {
    auto sim = sched::simulate(sched::zero_bubble_v{}, 4, 4);
    auto json = sched::to_chrome_trace(sim.timeline);
    CHECK(valid_json(json));
    CHECK(count(json, "\"ph\":\"M\"") == 2);
    CHECK(count(json, "\"ph\":\"X\"") == sim.timeline.actions.size());
    // Worker 0 runs stages 0 and 3, worker 1 stages 1 and 2.
    CHECK(
        contains(json, "\"tid\":0,\"ts\":0.000,\"dur\":1.000,\"args\":{\"stage\":0,\"micro\":0}"));
    CHECK(count(json, "\"tid\":0,") ==
          count(json, "\"stage\":0,") + count(json, "\"stage\":3,") + 1);
    auto dual = sched::simulate(sched::dualpipe_v{}, 4, 4);
    auto svg = sched::to_svg(dual.timeline, {.title = "DualPipeV"});
    CHECK(balanced_xml(svg));
    CHECK(count(svg, "<rect") == dual.timeline.actions.size());
    CHECK(contains(svg, ">worker 1<"));
    CHECK_FALSE(contains(svg, ">worker 2<"));
    // Stages 2 and 3 (the way up) are drawn paler.
    std::size_t up = 0;
    for (const auto& a : dual.timeline.actions) up += a.action.stage >= 2;
    CHECK(count(svg, "fill-opacity=\"0.6\"") == up);
  }

  TEST_CASE("write_chrome_trace writes the file and names a bad path") {
    auto sim = sched::simulate(sched::one_f_one_b{}, 2, 2);
    const std::string path = temp_path("trace.json");
    sched::write_chrome_trace(sim.timeline, path);
    CHECK(valid_json(read(path)));
    std::remove(path.c_str());
    CHECK(
        contains(error_of([&] { sched::write_chrome_trace(sim.timeline, "/no/such/dir/t.json"); }),
                 "stagewise::schedule::write_chrome_trace: cannot open"));
  }
}
