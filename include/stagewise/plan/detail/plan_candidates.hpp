#pragma once

// What plan_pipeline weighs (plan/detail/pipeline_planner.hpp): the micro-batch counts, the
// schedules, and, for a stage count, the splits of the layers by time and by size.

#include "stagewise/core/batch.hpp"
#include "stagewise/plan/plan_options.hpp"
#include "stagewise/schedule/choose.hpp"
#include "stagewise/stage/block_partition.hpp"
#include "stagewise/stage/partition.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// The first `rows` rows of every tensor of `batch`: one micro-batch.
inline Batch first_rows(const Batch& batch, std::int64_t rows) {
  std::vector<torch::Tensor> out;
  for (const auto& t : batch) out.push_back(t.narrow(0, 0, rows));
  return batch.atomic() ? Batch(out[0]) : Batch(std::move(out));
}

// The micro-batch counts to weigh: as given, or every divisor of the rows up to 64.
inline std::vector<int> micro_batch_counts(const PlanOptions& o, std::int64_t rows) {
  std::vector<int> out;
  if (!o.micro_batches().empty()) {
    for (int m : o.micro_batches()) {
      TORCH_CHECK(rows % m == 0, "stagewise::plan_pipeline: the batch has ", rows,
                  " rows, which do not split into ", m,
                  " equal micro-batches; give counts that divide the batch");
      out.push_back(m);
    }
    return out;
  }
  for (int m = 1; m <= std::min<std::int64_t>(rows, 64); ++m) {
    if (rows % m == 0) out.push_back(m);
  }
  return out;
}

// The schedules to weigh: the built-in candidates, or those named.
inline std::vector<schedule::ScheduleCandidate> plan_schedules(const PlanOptions& o) {
  auto all = schedule::default_candidates();
  if (o.schedules().empty()) return all;
  std::vector<schedule::ScheduleCandidate> out;
  for (const auto& name : o.schedules()) {
    auto it = std::find_if(all.begin(), all.end(),
                           [&](const auto& c) { return c.schedule.name() == name; });
    std::string known;
    for (const auto& c : all) known += (known.empty() ? "" : ", ") + c.schedule.name();
    TORCH_CHECK(it != all.end(), "stagewise::PlanOptions: no built-in schedule is named '", name,
                "'; give some of: ", known);
    out.push_back(*it);
  }
  return out;
}

// The splits to weigh for `stages` stages at one micro-batch: the exact min-max split of the
// layers' times, and of their sizes (activations plus parameters, gradients and optimizer
// state), without repeats.
inline std::vector<std::pair<std::string, balance>> splits_of(const std::vector<double>& times,
                                                             const std::vector<double>& sizes,
                                                             int stages) {
  std::vector<std::pair<std::string, balance>> out;
  auto add = [&](const std::string& by, const std::vector<double>& costs) {
    const auto sizes_of = block_sizes(costs, stages);
    balance b(sizes_of.begin(), sizes_of.end());
    for (const auto& [name, seen] : out) {
      if (seen == b) return;
    }
    out.emplace_back(by, std::move(b));
  };
  add("time", times);
  add("size", sizes);
  return out;
}

}  // namespace stagewise::detail
