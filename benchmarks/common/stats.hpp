#pragma once

// The spread of a set of measurements: minimum, median and maximum.

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise::bench {

/// Minimum, median and maximum of a set of samples (NaN for all three when there are none).
/// Benchmarks report all three, so that a figure measured on a loaded machine shows its spread.
///   auto s = summarize({3.0, 1.0, 2.0});  // s.min == 1, s.median == 2, s.max == 3
struct Summary {
  double min = std::numeric_limits<double>::quiet_NaN();
  double median = std::numeric_limits<double>::quiet_NaN();
  double max = std::numeric_limits<double>::quiet_NaN();
};

/// Summarizes `samples`; the median of an even count is the mean of the two middle samples.
inline Summary summarize(std::vector<double> samples) {
  Summary s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  s.min = samples.front();
  s.max = samples.back();
  s.median = n % 2 == 1 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
  return s;
}

/// A figure for a summary line: three decimals, or "nan" (a figure that could not be measured).
///   fixed3(1.23456) == "1.235"
inline std::string fixed3(double v) {
  if (std::isnan(v)) return "nan";
  std::ostringstream s;
  s.precision(3);
  s << std::fixed << v;
  return s.str();
}

}  // namespace stagewise::bench
