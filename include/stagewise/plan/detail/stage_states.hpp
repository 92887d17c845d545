#pragma once

// What each stage holds besides its cells, for plan_pipeline's memory model: its parameters,
// gradients and optimizer state from its costs and the optimizer, and with replicas what one
// replica holds (schedule::replica_state, the owned share when sharded).

#include "stagewise/optim/shard_owners.hpp"
#include "stagewise/plan/plan_options.hpp"
#include "stagewise/plan/stage_costs.hpp"
#include "stagewise/plan/worker_memory.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace stagewise::detail {

// The share of `bytes` (a stage's tensors) the most loaded of `d` replicas owns when they shard it
// (optim::shard_owners); 0 when unknown.
inline double owned_share(const std::vector<double>& bytes, int d) {
  if (bytes.empty() || d <= 1) return 0;
  std::vector<std::int64_t> b;
  for (double x : bytes) b.push_back(static_cast<std::int64_t>(x));
  const auto loads = optim::shard_loads(b, optim::shard_owners(b, d), d);
  const auto total = std::accumulate(b.begin(), b.end(), std::int64_t{0});
  if (total == 0) return 0;
  return static_cast<double>(*std::max_element(loads.begin(), loads.end())) /
         static_cast<double>(total);
}

// What each stage holds besides its cells, from its costs and the optimizer (and, with
// replicas, what one replica holds: schedule::replica_state).
inline std::vector<schedule::StageState> stage_states(const std::vector<StageCosts>& costs,
                                                      const PlanOptions& o) {
  std::vector<schedule::StageState> out;
  for (const auto& c : costs) {
    const schedule::StageState whole{.params = c.param_bytes,
                                     .grads = c.param_bytes,
                                     .optimizer = o.state_per_param() * c.param_bytes,
                                     .step_working = o.step_temporaries() * c.largest_param_bytes};
    out.push_back(
        schedule::replica_state(whole, {.replicas = o.replicas(),
                                        .shard_optimizer_state = o.shard_optimizer_state(),
                                        .shard_gradients = o.shard_gradients(),
                                        .bucket_bytes = static_cast<double>(o.bucket_bytes()),
                                        .largest_tensor = c.largest_param_bytes,
                                        .owned_share = owned_share(c.tensor_bytes, o.replicas())}));
  }
  return out;
}

}  // namespace stagewise::detail
