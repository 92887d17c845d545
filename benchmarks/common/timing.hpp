#pragma once

// Timing helpers for benchmarks: warm-up, then the median of repeated runs.

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace stagewise::bench {

/// Runs `fn` `warmup` times, then `iterations` times, and returns the median in microseconds.
inline double median_us(const std::function<void()>& fn, int iterations = 20, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> us;
  us.reserve(iterations);
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

}  // namespace stagewise::bench
