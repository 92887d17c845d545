#pragma once

// plan_pipeline's model of optimizer state off the device (PlanOptions().optimizer_store): for a
// stage and its share (none, half, all: optim::choose_offloaded's whole tensors, largest first,
// as the pipe chooses them), what it holds (the state left on the device, the step temporaries of
// the parameters left there, the state in the store, the bytes moved per step) and what its step
// costs (the device's part, and the host's: the host steps and the copies at the store's speed);
// and when the host steps end: with the fused step, each worker's host thread steps a stage's
// parameters once its last B or W has handed them over, beside the rest of the pipeline.

#include "stagewise/optim/state_offload.hpp"
#include "stagewise/plan/worker_memory.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/simulate.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

// What the model needs of a stage: its parameters' bytes (in the stage's order), its optimizer
// step's time on the device and on the host, and the optimizer's bytes of state and of step
// temporaries per parameter byte.
struct StateOffloadStage {
  std::vector<std::int64_t> param_bytes;
  double device_step = 0;  // seconds, every parameter
  double host_step = 0;    // seconds, every parameter, on the host
  double state_per_param = 2.0;
  double step_temporaries = 2.0;
  double speed = 4e9;  // the store's bytes per second
};

// A stage with `share` of its state off the device: what it holds, and its step's parts.
struct OffloadedStage {
  schedule::StageState state;
  double device_step = 0;   // seconds of the step left on the device
  double host_seconds = 0;  // the host steps and the copies of the offloaded parameters
};

inline OffloadedStage offloaded_stage(const StateOffloadStage& s, double share) {
  const auto chosen = optim::choose_offloaded(s.param_bytes, share);
  double total = 0, off = 0, largest_left = 0;
  for (std::size_t k = 0; k < s.param_bytes.size(); ++k) {
    const auto b = static_cast<double>(s.param_bytes[k]);
    total += b;
    if (chosen[k]) {
      off += b;
    } else {
      largest_left = std::max(largest_left, b);
    }
  }
  const double left = total - off;
  const double part = total > 0 ? off / total : 0.0;
  OffloadedStage out;
  out.state.params = total;
  out.state.grads = total;
  out.state.optimizer = s.state_per_param * left;
  out.state.step_working = s.step_temporaries * largest_left;
  out.state.optimizer_offloaded = s.state_per_param * off;
  // Each step: the gradient and the value to the host and the value back; the state read from
  // the store and written to it.
  out.state.moved = 3.0 * off + 2.0 * s.state_per_param * off;
  out.device_step = (1.0 - part) * s.device_step;
  out.host_seconds = part * s.host_step + out.state.moved / s.speed;
  return out;
}

// The step's end with the host steps of `host` (seconds per stage; empty: none): with the fused
// step, worker w's host thread takes each of its stages' parameters when the stage's last B or W
// ends (from `sim`) and steps them in that order, beside the pipeline; the step ends when the
// pipeline and every host thread have. Unfused, the host steps follow the pipeline, one after
// another (the optimizer's step() hands them over from one thread).
inline double with_host_steps(const schedule::Simulation& sim, const schedule::Plan& plan,
                              const std::vector<double>& host, bool fused, double seconds) {
  if (host.empty()) return seconds;
  if (!fused) return seconds + std::accumulate(host.begin(), host.end(), 0.0);
  std::vector<double> last_end(static_cast<std::size_t>(plan.stages), 0.0);
  for (const auto& e : sim.timeline.actions) {
    const auto kind = e.action.kind;
    if (kind != schedule::ActionKind::backward && kind != schedule::ActionKind::weight_grad)
      continue;
    auto& t = last_end[static_cast<std::size_t>(e.action.stage)];
    t = std::max(t, e.end);
  }
  double end = seconds;
  for (int w = 0; w < plan.workers; ++w) {
    std::vector<int> stages = plan.stages_of(w);
    std::sort(stages.begin(), stages.end(), [&](int a, int b) {
      return last_end[static_cast<std::size_t>(a)] < last_end[static_cast<std::size_t>(b)];
    });
    double t = 0;
    for (int j : stages) {
      t = std::max(t, last_end[static_cast<std::size_t>(j)]) + host[static_cast<std::size_t>(j)];
    }
    end = std::max(end, t);
  }
  return end;
}

// A setting's words: "none", "half", "all", or the share.
inline std::string share_name(double share) {
  if (share == 0.0) return "none";
  if (share == 0.5) return "half";
  if (share == 1.0) return "all";
  return std::to_string(share);
}

inline std::string describe_shares(const std::vector<double>& shares) {
  std::string out;
  for (std::size_t j = 0; j < shares.size(); ++j) out += (j ? " | " : "") + share_name(shares[j]);
  return out;
}

// The share after `share` in the order a stage's is raised: none, half, all.
inline double next_share(double share) {
  return share < 0.5 ? 0.5 : 1.0;
}

}  // namespace stagewise::detail
