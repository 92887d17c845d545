#pragma once

#include "stagewise/plan/link_speed.hpp"
#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/group.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace stagewise::distributed {

/// What `measure_link` times: all-reduces of each size in `bytes` (default 16 KiB, 256 KiB and
/// 4 MiB), `rounds` times each after an untimed one, with tensors on `device` (the CPU for Gloo;
/// the rank's GPU for NCCL).
///   stagewise::distributed::MeasureLinkOptions{.bytes = {1 << 20, 64 << 20}, .rounds = 3}
struct MeasureLinkOptions {
  std::vector<std::int64_t> bytes = {16 << 10, 256 << 10, 4 << 20};
  int rounds = 5;
  torch::Device device = torch::kCPU;
};

namespace detail {

// The least-squares line t = a + b * x through the points, with a >= 0 and b > 0 (noise can
// tip a fitted line either way: a is then 0 and b the mean slope through the origin).
inline std::pair<double, double> fit_line(const std::vector<double>& x,
                                          const std::vector<double>& t) {
  const double n = static_cast<double>(x.size());
  double sx = 0, st = 0, sxx = 0, sxt = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    st += t[i];
    sxx += x[i] * x[i];
    sxt += x[i] * t[i];
  }
  const double det = n * sxx - sx * sx;
  double b = det > 0 ? (n * sxt - sx * st) / det : 0.0;
  double a = (st - b * sx) / n;
  if (a < 0 || b <= 0) {
    a = 0;
    b = sxx > 0 ? sxt / sxx : 0.0;
  }
  return {a, b};
}

}  // namespace detail

/// The speed of the job's links, measured over its own process group (`job.collectives`):
/// all-reduces of a few sizes, timed on every rank; the ranks' times are averaged (so every rank
/// returns the same speed), the median of each size's rounds is fitted with a line (a fixed cost
/// plus a cost per byte), and the line is read as a ring all-reduce's: 2(n-1) messages of B/n
/// bytes (`LinkSpeed`). For `PlanOptions().link(...)`, which costs the replicas' gradient
/// exchange with it. Every rank of the job calls it at the same point, before other
/// collectives; a job of one rank has no link and gets a free one. About a second on loopback.
///   auto job = sw::runtime::connect(sw::runtime::rendezvous_env());
///   auto link = sw::distributed::measure_link(job);  // e.g. "41 us + 1.9 GB/s"
///   auto plan = sw::plan_pipeline(model, x, y, loss_fn, sw::PlanOptions().ranks(job.env.world_size)
///                                     .memory_per_worker(cap).link(link));
inline LinkSpeed measure_link(const runtime::Connection& job, const MeasureLinkOptions& options = {}) {
  const char* who = "stagewise::distributed::measure_link";
  TORCH_CHECK(static_cast<bool>(job.collectives), who,
              ": the connection has no collectives; build it with runtime::connect");
  TORCH_CHECK(!options.bytes.empty() && options.rounds >= 1, who,
              ": give at least one size and one round (MeasureLinkOptions)");
  for (auto b : options.bytes) {
    TORCH_CHECK(b >= 4, who, ": a probe of ", b, " bytes is too small; give sizes of 4 bytes or more");
  }
  const int n = job.collectives.size();
  if (n <= 1) return LinkSpeed{};
  const auto& group = job.collectives;
  std::vector<double> medians;
  for (auto bytes : options.bytes) {
    auto t = torch::ones({bytes / 4}, torch::TensorOptions().dtype(torch::kFloat).device(options.device));
    std::vector<at::Tensor> one{t};
    std::vector<double> times;
    for (int r = 0; r <= options.rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      group.all_reduce_sum(one)->wait();
      if (options.device.is_cuda()) t.cpu();  // the reduction's end, on the host
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) times.push_back(s);  // the first round sets up buffers
    }
    std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2),
                     times.end());
    medians.push_back(times[times.size() / 2]);
  }
  // Every rank's medians, averaged: one line for the job, the same on every rank.
  auto all = torch::tensor(medians, torch::kDouble).to(options.device);
  std::vector<at::Tensor> sum{all};
  group.all_reduce_sum(sum)->wait();
  all = all.to(torch::kCPU) / static_cast<double>(n);
  std::vector<double> t(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
  std::vector<double> x(options.bytes.begin(), options.bytes.end());
  const auto [a, b] = detail::fit_line(x, t);
  LinkSpeed out;
  const double steps = 2.0 * (n - 1);
  out.latency_seconds = a / steps;
  out.bytes_per_second = b > 0 ? steps / static_cast<double>(n) / b
                               : std::numeric_limits<double>::infinity();
  return out;
}

}  // namespace stagewise::distributed
