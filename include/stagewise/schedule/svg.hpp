#pragma once

#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

namespace stagewise::schedule {

/// How `to_svg` draws a timeline.
struct SvgOptions {
  std::string title;         ///< first line above the rows (empty: none)
  double width = 960.0;      ///< pixels for the whole span
  double row_height = 24.0;  ///< pixels per worker row
};

namespace detail {

inline std::string svg_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return buf;
}

inline std::string svg_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

inline const char* svg_colour(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
      return "#4c78a8";
    case ActionKind::backward:
      return "#54a24b";
    case ActionKind::input_grad:
      return "#72b7b2";
    case ActionKind::weight_grad:
      return "#f58518";
    case ActionKind::recompute:
      return "#9d755d";
    case ActionKind::offload:
      return "#b279a2";
    case ActionKind::reload:
      return "#e45756";
  }
  return "#888888";
}

inline const char* svg_kind_name(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
      return "F forward";
    case ActionKind::backward:
      return "B backward";
    case ActionKind::input_grad:
      return "I input grad";
    case ActionKind::weight_grad:
      return "W weight grad";
    case ActionKind::recompute:
      return "R recompute";
    case ActionKind::offload:
      return "O offload";
    case ActionKind::reload:
      return "L reload";
  }
  return "?";
}

}  // namespace detail

/// Draws a timeline as an SVG picture: one row per worker (per stage unless interleaved), one
/// coloured box per action labelled with its micro-batch (F blue, B green, I teal, W orange,
/// R brown; a worker's later virtual stages paler), idle time left blank so bubbles show; copies
/// (O offload purple, L reload red) as thin bars along the bottom of their worker's row, since
/// they run beside the compute.
/// Exactly one `<rect>` per action; hover a box for its full name.
///   auto sim = stagewise::schedule::simulate(stagewise::schedule::zero_bubble_h1{}, 4, 8);
///   std::string svg = stagewise::schedule::to_svg(sim.timeline, {.title = "ZB-H1"});
inline std::string to_svg(const Timeline& t, const SvgOptions& options = {}) {
  using detail::svg_number;
  const double label_width = 80.0;
  const double margin = 10.0;
  const double top = options.title.empty() ? margin : 30.0;
  const double gap = 4.0;
  const double row = options.row_height;
  const int rows = std::max(t.workers, 1);
  const double t0 = t.begin();
  const double span = t.span() > 0.0 ? t.span() : 1.0;
  const double scale = options.width / span;
  const double legend_y = top + rows * (row + gap) + 16.0;
  const double total_width = label_width + options.width + 2 * margin;
  const double total_height = legend_y + 30.0;

  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + svg_number(total_width) +
                  "\" height=\"" + svg_number(total_height) + "\" viewBox=\"0 0 " +
                  svg_number(total_width) + " " + svg_number(total_height) +
                  "\" font-family=\"sans-serif\">\n";
  if (!options.title.empty()) {
    s += "<text x=\"" + svg_number(margin) + "\" y=\"20\" font-size=\"14\">" +
         detail::svg_escape(options.title) + "</text>\n";
  }
  const bool interleaved = t.workers < t.stages;
  for (int w = 0; w < rows; ++w) {
    const double y = top + w * (row + gap);
    s += "<text x=\"" + svg_number(margin) + "\" y=\"" + svg_number(y + row * 0.7) +
         "\" font-size=\"12\">" + (interleaved ? "worker " : "stage ") + std::to_string(w) +
         "</text>\n";
    // The row's background (a path, so that every <rect> is an action): gaps in it are bubbles.
    s += "<path d=\"M" + svg_number(label_width) + " " + svg_number(y) + "h" +
         svg_number(options.width) + "v" + svg_number(row) + "h-" + svg_number(options.width) +
         "z\" fill=\"#f0f0f0\"/>\n";
  }
  for (const auto& a : t.actions) {
    const double x = label_width + (a.start - t0) * scale;
    const double w = std::max((a.end - a.start) * scale, 0.5);
    // Copies (O, L) run beside the compute: a thin bar along the bottom of the worker's row.
    const bool copy = is_copy(a.action.kind);
    const double h = copy ? row * 0.3 : row;
    const double y = top + a.worker * (row + gap) + (copy ? row - h : 0.0);
    const int chunk = t.workers > 0 ? a.action.stage / t.workers : 0;
    s += "<rect x=\"" + svg_number(x) + "\" y=\"" + svg_number(y) + "\" width=\"" + svg_number(w) +
         "\" height=\"" + svg_number(h) + "\" fill=\"" + detail::svg_colour(a.action.kind) + "\"" +
         (chunk % 2 == 1 ? " fill-opacity=\"0.6\"" : "") +
         " stroke=\"#ffffff\" stroke-width=\"0.5\"><title>" + to_string(a.action) + " " +
         svg_number(a.start - t0) + "-" + svg_number(a.end - t0) + " " +
         detail::svg_escape(t.unit) + "</title></rect>\n";
    if (w >= 10.0 && !copy) {
      s += "<text x=\"" + svg_number(x + w / 2) + "\" y=\"" + svg_number(y + row * 0.68) +
           "\" font-size=\"11\" text-anchor=\"middle\" fill=\"#ffffff\">" +
           std::to_string(a.action.micro) + "</text>\n";
    }
  }
  double x = label_width;
  for (auto k :
       {ActionKind::forward, ActionKind::backward, ActionKind::input_grad, ActionKind::weight_grad,
        ActionKind::recompute, ActionKind::offload, ActionKind::reload}) {
    if (std::none_of(t.actions.begin(), t.actions.end(),
                     [&](const TimedAction& a) { return a.action.kind == k; })) {
      continue;
    }
    s += "<circle cx=\"" + svg_number(x + 5) + "\" cy=\"" + svg_number(legend_y) +
         "\" r=\"5\" fill=\"" + detail::svg_colour(k) + "\"/>\n";
    s += "<text x=\"" + svg_number(x + 14) + "\" y=\"" + svg_number(legend_y + 4) +
         "\" font-size=\"12\">" + detail::svg_kind_name(k) + "</text>\n";
    x += 110.0;
  }
  s += "<text x=\"" + svg_number(x + 10) + "\" y=\"" + svg_number(legend_y + 4) +
       "\" font-size=\"12\">makespan " + svg_number(t.span()) + " " + detail::svg_escape(t.unit) +
       ", bubble " + svg_number(100.0 * t.bubble()) + "%</text>\n";
  s += "</svg>\n";
  return s;
}

/// Writes `to_svg(t, options)` to `path`.
inline void write_svg(const Timeline& t, const std::string& path, const SvgOptions& options = {}) {
  std::ofstream out(path);
  TORCH_CHECK(out, "stagewise::schedule::write_svg: cannot open '", path,
              "' for writing; give a path in a directory that exists and is writable");
  out << to_svg(t, options);
}

}  // namespace stagewise::schedule
