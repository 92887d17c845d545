#pragma once

// The schedules benchmark's memory section: a model of 2K blocks trained by a pipe of K workers
// under 1F1B, ZB-H1, ZB-V, V-Half and V-Min (M = 2K micro-batches, checkpoint never), the split
// schedules both with the split backward's release after I and keeping the whole graph until W:
// each worker's measured peak (counting allocator, one step after a warm-up) beside
// schedule::peak_bytes fed with cell_bytes, and the step times over rounds.

#include "benchmarks/common/cell_bytes.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/stats.hpp"
#include "benchmarks/common/timing.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace stagewise::bench {

/// A model for the memory section: `make(n)` builds n blocks (seeded), `micro_batch` is one
/// micro-batch's shape (output alike), `name` describes both.
struct MemoryModel {
  std::string name;
  std::function<torch::nn::Sequential(int)> make;
  std::vector<std::int64_t> micro_batch;
};

/// One schedule's pipe in the memory section and what was measured on it.
struct MemoryRow {
  std::string name;
  int stages = 0;
  bool split = false;  ///< the schedule splits backwards into I and W
  runtime::SplitBackward::Keep keep = runtime::SplitBackward::Keep::what_w_reads;
  bool timed = true;  ///< step times measured (the rows keeping the whole graph: memory only)
  std::function<void()> step;
  schedule::Plan plan;
  std::vector<double> step_ms;      ///< sorted, one per round
  std::vector<double> round_ms;     ///< the same in round order
  std::vector<long long> measured;  ///< per worker, peak rise in one step
  std::vector<double> predicted;    ///< schedule::peak_bytes
  int worker_cells = 0;             ///< the simulator's most cells alive on one worker
  /// The worst worker's measured peak.
  double worst() const {
    return measured.empty() ? 0.0 : double(*std::max_element(measured.begin(), measured.end()));
  }
  /// The median step time (0 when not timed).
  double median_ms() const { return step_ms.empty() ? 0.0 : step_ms[step_ms.size() / 2]; }
  /// The simulator's cells per worker in 1F1B's units: a V schedule's stage is half a worker's
  /// share of the model.
  double cells() const {
    return double(worker_cells) * static_cast<double>(plan.programs.size()) / stages;
  }
};

/// The pipe of `name` on `model` (2K blocks over `stages` stages, M = 2K) under `s`, keeping
/// `keep` between I and W.
template <class Schedule>
MemoryRow memory_row(const std::string& name, const MemoryModel& model, int k, int stages,
                     bool split, Schedule s,
                     runtime::SplitBackward::Keep keep = runtime::SplitBackward::Keep::what_w_reads) {
  auto seq = model.make(2 * k);
  auto pipe = Pipe(seq, even_balance(seq->size(), stages),
                   PipeOptions().chunks(2 * k).checkpoint("never"));
  auto shape = model.micro_batch;
  shape[0] *= 2 * k;
  const auto x = torch::randn(shape);
  const auto t = torch::randn(shape);
  MemoryRow r;
  r.name = name;
  r.stages = stages;
  r.split = split;
  r.keep = keep;
  r.timed = keep == runtime::SplitBackward::Keep::what_w_reads;
  r.step = [pipe, s, x, t]() mutable {
    pipe->train_step(x, t, [](const torch::Tensor& o, const torch::Tensor& y) {
      return torch::mse_loss(o, y);
    }, s);
  };
  r.plan = schedule::plan(s, stages, 2 * k);
  const auto sim = schedule::simulate(s, stages, 2 * k, schedule::Costs{});
  r.worker_cells = *std::max_element(sim.worker_peak_in_flight.begin(),
                                     sim.worker_peak_in_flight.end());
  return r;
}

/// The five schedules on `model` with K = `k` workers (2K stages for the V schedules), the split
/// ones once releasing after I and once keeping the whole graph (`with_before`).
inline std::vector<MemoryRow> memory_rows(const MemoryModel& model, int k, bool with_before) {
  using Keep = runtime::SplitBackward::Keep;
  std::vector<MemoryRow> rows;
  rows.push_back(memory_row("one_f_one_b", model, k, k, false, schedule::one_f_one_b{}));
  for (Keep keep : {Keep::what_w_reads, Keep::whole_graph}) {
    if (keep == Keep::whole_graph && !with_before) break;
    rows.push_back(memory_row("zero_bubble_h1", model, k, k, true, schedule::zero_bubble_h1{}, keep));
    rows.push_back(
        memory_row("zero_bubble_v", model, k, 2 * k, true, schedule::zero_bubble_v{}, keep));
    rows.push_back(memory_row("v_half", model, k, 2 * k, true, schedule::v_half{}, keep));
    rows.push_back(memory_row("v_min", model, k, 2 * k, true, schedule::v_min{}, keep));
  }
  return rows;
}

/// Runs `f` with `keep` as SplitBackward's default (the pipes' workers make theirs that way).
template <class F>
void keeping(runtime::SplitBackward::Keep keep, F&& f) {
  const auto old = runtime::SplitBackward::set_default_keep(keep);
  f();
  runtime::SplitBackward::set_default_keep(old);
}

/// Measures the rows: a warm-up step each, `rounds` rounds of one timed step per timed row (so
/// that load from other processes disturbs them alike), then each row's per-worker peak in one
/// step and schedule::peak_bytes for it.
inline void measure_memory(std::vector<MemoryRow>& rows, const MemoryModel& model, int k,
                           int rounds) {
  auto& memory = counting_allocator();
  for (auto& r : rows) keeping(r.keep, r.step);  // warm-up: gradients exist from here on
  for (int round = 0; round < rounds; ++round) {
    for (auto& r : rows) {
      if (r.timed) r.round_ms.push_back(median_us([&] { r.step(); }, 1, 0) / 1000.0);
    }
  }
  for (auto& r : rows) {
    r.step_ms = r.round_ms;
    std::sort(r.step_ms.begin(), r.step_ms.end());
    keeping(r.keep, [&] {
      const auto before = memory.thread_current();
      memory.reset_peak();
      r.step();
      // Only this pipe's workers allocate during its step: its threads, in the order they were
      // made.
      for (long long rise : memory.thread_rises(before)) {
        if (rise > 1024) r.measured.push_back(rise);
      }
      const int per_stage = 2 * k / r.stages;
      r.predicted = schedule::peak_bytes(
          r.plan, stage_cell_bytes([&] { return model.make(per_stage); }, r.stages,
                                   model.micro_batch, r.split));
    });
  }
}

/// Prints the rows: step times, the worst worker's peak over 1F1B's beside the simulator's cells
/// over 1F1B's, and each worker's measured / predicted peak.
inline void print_memory(const std::vector<MemoryRow>& rows) {
  std::printf("  %-15s %-12s %9s %9s %9s %9s %7s %7s %7s | %s\n", "schedule", "keeps", "median ms",
              "min", "max", "worst MiB", "/ 1F1B", "cells", "bytes/c", "per worker: measured/predicted MiB");
  const MemoryRow& base = rows.front();
  for (const auto& r : rows) {
    std::string per;
    for (std::size_t w = 0; w < r.predicted.size(); ++w) {
      const double m = w < r.measured.size() ? double(r.measured[w]) / (1 << 20) : -1.0;
      char buf[48];
      std::snprintf(buf, sizeof buf, " %.2f/%.2f", m, r.predicted[w] / (1 << 20));
      per += buf;
    }
    const char* keeps = !r.split ? "-"
                        : r.keep == runtime::SplitBackward::Keep::what_w_reads ? "what W reads"
                                                                                : "whole graph";
    const double ratio = r.worst() / base.worst();
    const double cells = r.cells() / base.cells();
    if (!r.step_ms.empty()) {
      std::printf("  %-15s %-12s %9.1f %9.1f %9.1f", r.name.c_str(), keeps, r.median_ms(),
                  r.step_ms.front(), r.step_ms.back());
    } else {
      std::printf("  %-15s %-12s %9s %9s %9s", r.name.c_str(), keeps, "-", "-", "-");
    }
    std::printf(" %9.2f %7.3f %7.3f %7.3f |%s\n", r.worst() / (1 << 20), ratio, cells,
                ratio / cells, per.c_str());
  }
}

/// `r`'s step time over `base`'s, taken within each round: median, min and max.
///   auto s = time_ratio(memory_row_of(rows, "v_half"), rows.front());
inline Summary time_ratio(const MemoryRow& r, const MemoryRow& base) {
  std::vector<double> ratios;
  for (std::size_t k = 0; k < r.round_ms.size() && k < base.round_ms.size(); ++k)
    ratios.push_back(r.round_ms[k] / base.round_ms[k]);
  return ratios.empty() ? Summary{} : summarize(ratios);
}

/// The row of `name` keeping `keep` (split schedules) among `rows`.
inline const MemoryRow& memory_row_of(
    const std::vector<MemoryRow>& rows, const std::string& name,
    runtime::SplitBackward::Keep keep = runtime::SplitBackward::Keep::what_w_reads) {
  for (const auto& r : rows) {
    if (r.name == name && (!r.split || r.keep == keep)) return r;
  }
  TORCH_CHECK(false, "no memory row ", name);
  return rows.front();
}

}  // namespace stagewise::bench
