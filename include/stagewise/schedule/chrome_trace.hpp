#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

namespace stagewise::schedule {

namespace detail {

inline const char* trace_category(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
      return "forward";
    case ActionKind::backward:
      return "backward";
    case ActionKind::input_grad:
      return "input_grad";
    case ActionKind::weight_grad:
      return "weight_grad";
    case ActionKind::recompute:
      return "recompute";
    case ActionKind::offload:
      return "offload";
    case ActionKind::reload:
      return "reload";
  }
  return "other";
}

}  // namespace detail

/// A timeline as Chrome-trace JSON (the Trace Event Format), to open in Perfetto
/// (ui.perfetto.dev) or chrome://tracing: one complete event ("ph":"X") per action, named like
/// "F3", on one track per worker (copies O and L on a second track per worker), with the stage and
/// micro-batch in its args. Times start at 0; `us_per_unit` converts the timeline's unit to
/// microseconds (1 for a recorded step).
///   stagewise::schedule::Timeline t;
///   pipe->train_step(x, y, loss_fn, stagewise::schedule::one_f_one_b{}, &t);
///   std::ofstream("step.json") << stagewise::schedule::to_chrome_trace(t);
inline std::string to_chrome_trace(const Timeline& t, double us_per_unit = 1.0) {
  auto number = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", x);
    return std::string(buf);
  };
  const bool interleaved = t.workers < t.stages;
  std::string s = "{\"traceEvents\":[\n";
  bool first = true;
  auto add = [&](const std::string& event) {
    s += (first ? "" : ",\n") + event;
    first = false;
  };
  for (int w = 0; w < t.workers; ++w) {
    add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" + std::to_string(w) +
        ",\"args\":{\"name\":\"" + (interleaved ? "worker " : "stage ") + std::to_string(w) +
        "\"}}");
  }
  // Copies (O, L) overlap their worker's compute: they get a track of their own per worker.
  const bool copies = std::any_of(t.actions.begin(), t.actions.end(),
                                  [](const TimedAction& a) { return is_copy(a.action.kind); });
  for (int w = 0; copies && w < t.workers; ++w) {
    add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" +
        std::to_string(t.workers + w) + ",\"args\":{\"name\":\"copies " + std::to_string(w) +
        "\"}}");
  }
  const double t0 = t.begin();
  for (const auto& a : t.actions) {
    const int track = is_copy(a.action.kind) ? t.workers + a.worker : a.worker;
    add("{\"name\":\"" + std::string(1, static_cast<char>(a.action.kind)) +
        std::to_string(a.action.micro) + "\",\"cat\":\"" + detail::trace_category(a.action.kind) +
        "\",\"ph\":\"X\",\"pid\":0,\"tid\":" + std::to_string(track) +
        ",\"ts\":" + number((a.start - t0) * us_per_unit) +
        ",\"dur\":" + number((a.end - a.start) * us_per_unit) + ",\"args\":{\"stage\":" +
        std::to_string(a.action.stage) + ",\"micro\":" + std::to_string(a.action.micro) + "}}");
  }
  s += "\n],\"displayTimeUnit\":\"ms\"}\n";
  return s;
}

/// Writes `to_chrome_trace(t, us_per_unit)` to `path`.
inline void write_chrome_trace(const Timeline& t, const std::string& path,
                               double us_per_unit = 1.0) {
  std::ofstream out(path);
  TORCH_CHECK(out, "stagewise::schedule::write_chrome_trace: cannot open '", path,
              "' for writing; give a path in a directory that exists and is writable");
  out << to_chrome_trace(t, us_per_unit);
}

}  // namespace stagewise::schedule
