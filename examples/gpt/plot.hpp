// The loss curve of examples/gpt.cpp as an SVG: training and validation loss against step.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace gpt {

/// One logged point: the step, its training loss, and the validation loss (negative: not measured).
struct LossPoint {
  int64_t step = 0;
  double train = 0, valid = -1;
};

inline std::string loss_svg(const std::vector<LossPoint>& points, const std::string& title) {
  const double w = 640, h = 360, left = 56, right = 16, top = 32, bottom = 40;
  double max_loss = 0, min_loss = 1e30;
  int64_t last = 1;
  for (const auto& p : points) {
    for (double v : {p.train, p.valid}) {
      if (v >= 0) max_loss = std::max(max_loss, v), min_loss = std::min(min_loss, v);
    }
    last = std::max(last, p.step);
  }
  if (points.empty()) min_loss = 0, max_loss = 1;
  min_loss = std::max(0.0, min_loss - 0.1);
  const double span = std::max(1e-9, max_loss - min_loss);
  auto x = [&](double s) { return left + (w - left - right) * s / double(last); };
  auto y = [&](double v) { return top + (h - top - bottom) * (max_loss - v) / span; };
  char buf[256];
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"360\" "
                  "font-family=\"sans-serif\" font-size=\"12\">\n"
                  "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::snprintf(buf, sizeof buf, "<text x=\"%g\" y=\"20\">%s</text>\n", left, title.c_str());
  s += buf;
  for (int i = 0; i <= 4; ++i) {  // loss gridlines
    const double v = min_loss + span * i / 4;
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"8\" y=\"%.1f\">%.2f</text>\n",
                  left, y(v), w - right, y(v), y(v) + 4, v);
    s += buf;
  }
  std::snprintf(buf, sizeof buf,
                "<text x=\"%g\" y=\"%g\">step 0 .. %lld</text>\n", left, h - 12,
                static_cast<long long>(last));
  s += buf;
  auto line = [&](bool valid, const char* color, const char* name, double ly) {
    std::string pts;
    for (const auto& p : points) {
      const double v = valid ? p.valid : p.train;
      if (v < 0) continue;
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x(double(p.step)), y(v));
      pts += buf;
    }
    s += "<polyline fill=\"none\" stroke=\"" + std::string(color) + "\" stroke-width=\"1.5\" points=\"" +
         pts + "\"/>\n";
    std::snprintf(buf, sizeof buf,
                  "<text x=\"%g\" y=\"%g\" fill=\"%s\">%s</text>\n", w - right - 90, ly, color, name);
    s += buf;
  };
  line(false, "#1f77b4", "train", top + 12);
  line(true, "#d62728", "validation", top + 28);
  return s + "</svg>\n";
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  TORCH_CHECK(out, "gpt: cannot write '", path, "'");
  out << text;
}

}  // namespace gpt
