#pragma once

// distributed::Pipe(model, plan): every rank runs rank 0's plan. Each rank plans on its own
// profiles, and where two candidates' costs are close, ranks may choose differently; the ranks
// exchange what a step depends on (the split, the schedule, the micro-batches, each stage's
// checkpoint mode and offload, the ranks per pipeline, the replicas and their sharding, each
// stage's share of optimizer state off the device) at start-up, and every rank takes rank 0's.

#include "stagewise/core/checkpoint_mode.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/runtime/c10d/gather_text.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/schedule/builtins.hpp"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise::distributed::detail {

// What a step of `plan` depends on, as one line of text.
inline std::string plan_text(const PipelinePlan& plan) {
  std::ostringstream out;
  out << plan.schedule.name() << " " << plan.stages_per_worker << " " << plan.micro_batches << " "
      << (plan.fused_step ? 1 : 0) << " " << plan.split.size();
  for (auto layers : plan.split) out << " " << layers;
  for (auto mode : plan.checkpoints) out << " " << ::stagewise::to_string(mode);
  for (bool off : plan.offload_stages) out << " " << (off ? 1 : 0);
  out << " " << plan.workers << " " << plan.replicas << " " << (plan.shard_optimizer_state ? 1 : 0)
      << " " << (plan.shard_gradients ? 1 : 0) << " " << plan.ranks << " "
      << plan.optimizer_shares.size();
  out.precision(17);
  for (double share : plan.optimizer_shares) out << " " << share;
  return out.str();
}

// `plan` with the step's parts of `text` (plan_text of another rank's plan).
inline PipelinePlan plan_from_text(PipelinePlan plan, const std::string& text) {
  std::istringstream in(text);
  std::string name;
  std::size_t stages = 0;
  int fused = 0;
  in >> name >> plan.stages_per_worker >> plan.micro_batches >> fused >> stages;
  plan.fused_step = fused != 0;
  // "interleaved_one_f_one_b{2}": the built-in's name, its stages per worker apart.
  plan.schedule =
      schedule::builtin_schedule(name.substr(0, name.find('{')), plan.stages_per_worker);
  plan.split.assign(stages, 0);
  plan.checkpoints.assign(stages, Checkpoint::never);
  plan.offload_stages.assign(stages, false);
  for (auto& layers : plan.split) in >> layers;
  for (auto& mode : plan.checkpoints) {
    std::string m;
    in >> m;
    mode = checkpoint_mode(m);
  }
  for (std::size_t j = 0; j < stages; ++j) {
    int off = 0;
    in >> off;
    plan.offload_stages[j] = off != 0;
  }
  int state = 0, grads = 0;
  std::size_t shares = 0;
  in >> plan.workers >> plan.replicas >> state >> grads >> plan.ranks >> shares;
  plan.shard_optimizer_state = state != 0;
  plan.shard_gradients = grads != 0;
  plan.optimizer_shares.assign(shares, 0.0);
  for (auto& share : plan.optimizer_shares) in >> share;
  TORCH_CHECK(!in.fail(), "stagewise::distributed::Pipe: rank 0's plan could not be read ('",
              text, "'); every rank must run the same stagewise");
  return plan;
}

// Rank 0's plan, on every rank of the job.
inline PipelinePlan agreed_plan(const runtime::Connection& c, const PipelinePlan& plan,
                                const std::string& key, std::chrono::milliseconds timeout) {
  const auto all = runtime::gather_text(c, key, plan_text(plan), timeout,
                                        "the plan agreement (every rank must build the pipe)");
  return plan_from_text(plan, all.front());
}

}  // namespace stagewise::distributed::detail
