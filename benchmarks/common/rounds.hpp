#pragma once

// Alternating rounds: every variant of a benchmark runs once per round, in a rotating order, so
// that load from other processes hits all variants alike. Per-variant spread, and ratios taken
// round by round.

#include "benchmarks/common/cpu_time.hpp"
#include "benchmarks/common/stats.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::bench {

/// Runs named variants in alternating rounds and keeps, per round and variant, the median wall
/// time and the median process CPU time of `calls` calls. Ratios between variants are taken
/// within each round and summarized over the rounds; report their median.
///   Rounds r(/*rounds=*/9, /*calls=*/3);
///   r.add("sequential", [&] { loop(); });
///   r.add("pipe", [&] { pipe->train_step(x, t, mse); });
///   r.run();
///   r.print();                                            // min / median / max per variant
///   double speedup = r.wall_ratio("sequential", "pipe").median;
class Rounds {
 public:
  /// `rounds` rounds of `calls` timed calls per variant, after `warmup` untimed calls each.
  explicit Rounds(int rounds, int calls = 1, int warmup = 1)
      : rounds_(std::max(rounds, 1)), calls_(std::max(calls, 1)), warmup_(std::max(warmup, 0)) {}

  /// Adds a variant; `fn` runs one step of it.
  void add(std::string name, std::function<void()> fn) {
    variants_.push_back(Variant{std::move(name), std::move(fn), {}, {}});
  }

  /// Warms every variant up, then runs the rounds. Round r starts at variant r mod n.
  void run() {
    for (auto& v : variants_) {
      for (int i = 0; i < warmup_; ++i) v.fn();
    }
    const std::size_t n = variants_.size();
    for (int r = 0; r < rounds_; ++r) {
      for (std::size_t k = 0; k < n; ++k) {
        Variant& v = variants_[(static_cast<std::size_t>(r) + k) % n];
        std::vector<double> wall, cpu;
        for (int c = 0; c < calls_; ++c) {
          const double cpu0 = process_cpu_us();
          const auto t0 = std::chrono::steady_clock::now();
          v.fn();
          const auto t1 = std::chrono::steady_clock::now();
          cpu.push_back(process_cpu_us() - cpu0);
          wall.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        v.wall.push_back(summarize(wall).median);
        v.cpu.push_back(summarize(cpu).median);
      }
    }
  }

  /// Per-round wall times (microseconds) of a variant, in round order.
  const std::vector<double>& wall_samples(const std::string& name) const { return find(name).wall; }
  /// Per-round process CPU times (microseconds, all threads) of a variant, in round order.
  const std::vector<double>& cpu_samples(const std::string& name) const { return find(name).cpu; }

  /// Spread over the rounds of a variant's wall time (microseconds).
  Summary wall(const std::string& name) const { return summarize(find(name).wall); }
  /// Spread over the rounds of a variant's process CPU time (microseconds).
  Summary cpu(const std::string& name) const { return summarize(find(name).cpu); }

  /// Spread of wall(num) / wall(den), one ratio per round.
  Summary wall_ratio(const std::string& num, const std::string& den) const {
    return per_round([&](int r) { return find(num).wall[r] / find(den).wall[r]; });
  }
  /// Spread of cpu(num) / cpu(den), one ratio per round.
  Summary cpu_ratio(const std::string& num, const std::string& den) const {
    return per_round([&](int r) { return find(num).cpu[r] / find(den).cpu[r]; });
  }

  /// Spread of any figure computed from one round's samples, e.g. an overhead
  /// `(cpu_samples("pipe")[r] - cpu_samples("loop")[r]) / actions`.
  Summary per_round(const std::function<double(int)>& figure) const {
    std::vector<double> v;
    for (int r = 0; r < rounds_; ++r) v.push_back(figure(r));
    return summarize(v);
  }

  /// Number of rounds run (or to run).
  int rounds() const { return rounds_; }

  /// Prints one row per variant: wall and CPU time in milliseconds, min / median / max.
  void print(std::FILE* out = stdout) const {
    std::fprintf(out, "  %-46s %29s  %29s\n", "variant", "wall ms: min / median / max",
                 "process cpu ms: min / median / max");
    for (const auto& v : variants_) {
      const Summary w = summarize(v.wall), c = summarize(v.cpu);
      std::fprintf(out, "  %-46s %9.3f %9.3f %9.3f  %9.3f %9.3f %9.3f\n", v.name.c_str(),
                   w.min / 1e3, w.median / 1e3, w.max / 1e3, c.min / 1e3, c.median / 1e3,
                   c.max / 1e3);
    }
  }

 private:
  struct Variant {
    std::string name;
    std::function<void()> fn;
    std::vector<double> wall, cpu;
  };

  const Variant& find(const std::string& name) const {
    for (const auto& v : variants_) {
      if (v.name == name) return v;
    }
    TORCH_CHECK(false, "stagewise::bench::Rounds: no variant named '", name,
                "'; add it with add(name, fn) before asking for it");
  }

  int rounds_, calls_, warmup_;
  std::vector<Variant> variants_;
};

/// Prints one figure with its spread: `  what   median  [min, max] unit`.
///   print_figure("speed-up vs sequential", r.wall_ratio("seq", "pipe"), "x");
inline void print_figure(const std::string& what, const Summary& s, const std::string& unit,
                         std::FILE* out = stdout) {
  std::fprintf(out, "  %-52s %10.3f  [%.3f, %.3f] %s\n", what.c_str(), s.median, s.min, s.max,
               unit.c_str());
}

}  // namespace stagewise::bench
