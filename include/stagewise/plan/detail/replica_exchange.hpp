#pragma once

// The replicas' gradient exchange on a planned step's timeline, for plan_pipeline's ranks(N):
// each stage's exchange over its d replicas costed from the link (LinkSpeed) as the reducer does
// it (runtime/c10d: buckets of all-reduces; sharded, one summing reduce per owner and bucket,
// then each owner's broadcast of its updated parameters; ZeRO-2, a reduce-scatter per backward
// pass), started when the stage's gradients are final on the simulated timeline
// (schedule::reductions' points: its last B or W) and run beside the other stages' work; and the
// step's end on every rank: its last exchange, its optimizer steps (fused: each stage's as its
// exchange ends; unfused: all of the rank's after the pipeline) and the owners' parameters.

#include "stagewise/plan/link_speed.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/plan.hpp"
#include "stagewise/schedule/timeline.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace stagewise::detail {

// How one factorisation's replicas exchange gradients, per stage.
struct ReplicaExchange {
  int replicas = 1;
  bool shard_optimizer_state = false;
  bool shard_gradients = false;
  double bucket_bytes = 25.0 * (1 << 20);
  LinkSpeed link;
  std::vector<double> grad_bytes;  // per stage: its trainable parameters' bytes
};

// The bytes of each bucket a stage's `bytes` of gradients go in (the reducer's buckets).
inline std::vector<double> buckets_of(double bytes, double bucket_bytes) {
  std::vector<double> out;
  if (bytes <= 0) return out;
  const auto n = static_cast<std::size_t>(std::ceil(bytes / std::max(bucket_bytes, 1.0)));
  out.assign(n, bytes / static_cast<double>(n));
  return out;
}

// One sharded reduction of `bytes` (ReduceScatter::reduce, the default): one summing reduce per
// owner over its 1/d part; Gloo's reduce is a ring reduce-scatter of the part and each rank's
// chunk sent on to the owner.
inline double sharded_reduce_seconds(const LinkSpeed& link, double bytes, int d) {
  const double part = bytes / d;
  return d * (link.reduce_scatter_seconds(part, d) + link.latency_seconds +
              part / d / link.bytes_per_second);
}

// The stage's exchange after its last gradient: unsharded, every bucket's all-reduce; ZeRO-1,
// every bucket's sharded reduce; ZeRO-2 nothing more (each pass reduced its own).
inline double exchange_after_last(const ReplicaExchange& x, double bytes) {
  if (x.replicas <= 1 || x.shard_gradients) return 0.0;
  double t = 0;
  for (double b : buckets_of(bytes, x.bucket_bytes)) {
    t += x.shard_optimizer_state ? sharded_reduce_seconds(x.link, b, x.replicas)
                                 : x.link.all_reduce_seconds(b, x.replicas);
  }
  return t;
}

// ZeRO-2: each backward pass's reduce-scatter of the stage's gradients.
inline double exchange_per_pass(const ReplicaExchange& x, double bytes) {
  if (x.replicas <= 1 || !x.shard_gradients) return 0.0;
  double t = 0;
  for (double b : buckets_of(bytes, x.bucket_bytes))
    t += sharded_reduce_seconds(x.link, b, x.replicas);
  return t;
}

// Sharded: the owners' updated parameters to every replica (one broadcast per owner and bucket).
inline double parameter_gather_seconds(const ReplicaExchange& x, double bytes) {
  if (x.replicas <= 1 || !x.shard_optimizer_state) return 0.0;
  double t = 0;
  for (double b : buckets_of(bytes, x.bucket_bytes)) t += x.link.all_gather_seconds(b, x.replicas);
  return t;
}

// When each stage's exchange ends on `timeline` (simulated seconds): after its last B or W, or,
// ZeRO-2, after the queue of one reduce-scatter per B or W (each starts when its pass ends and
// the previous one is done).
inline std::vector<double> exchange_ends(const schedule::Timeline& timeline, int stages,
                                         const ReplicaExchange& x) {
  std::vector<std::vector<double>> passes(static_cast<std::size_t>(stages));
  for (const auto& a : timeline.actions) {
    if (a.action.kind == schedule::ActionKind::backward ||
        a.action.kind == schedule::ActionKind::weight_grad) {
      passes[static_cast<std::size_t>(a.action.stage)].push_back(a.end);
    }
  }
  std::vector<double> out;
  for (std::size_t j = 0; j < passes.size(); ++j) {
    auto& ends = passes[j];
    std::sort(ends.begin(), ends.end());
    const double bytes = j < x.grad_bytes.size() ? x.grad_bytes[j] : 0.0;
    const double per_pass = exchange_per_pass(x, bytes);
    double t = ends.empty() ? 0.0 : ends.back();
    if (per_pass > 0) {
      t = 0;
      for (double e : ends) t = std::max(t, e) + per_pass;
    }
    out.push_back(t + exchange_after_last(x, bytes));
  }
  return out;
}

// The step's end over every rank of one replica: the pipeline's makespan, or later a rank's last
// exchange and optimizer steps (`steps`, per stage, its share when sharded) and the owners'
// parameters. Fused (`fused_after_exchange`), a stage steps as its exchange ends; unfused, the
// rank steps all its stages once the pipeline returns. `fused_in_pipeline`: the steps ran in the
// simulated backward already (one replica).
inline double replica_step_seconds(const schedule::Timeline& timeline, const schedule::Plan& plan,
                                   const ReplicaExchange& x, const std::vector<double>& steps,
                                   bool fused_after_exchange, bool fused_in_pipeline) {
  const double makespan = timeline.span();
  const auto ends = exchange_ends(timeline, plan.stages, x);
  double last = makespan;
  for (int w = 0; w < plan.workers; ++w) {
    std::vector<int> mine;
    for (int j = 0; j < plan.stages; ++j) {
      if (plan.worker_of(j) == w) mine.push_back(j);
    }
    std::sort(mine.begin(), mine.end(), [&](int a, int b) {
      return ends[static_cast<std::size_t>(a)] < ends[static_cast<std::size_t>(b)];
    });
    double t = 0;
    for (int j : mine) {
      const auto k = static_cast<std::size_t>(j);
      const double step = fused_in_pipeline ? 0.0 : steps[k];
      const double gather = parameter_gather_seconds(x, x.grad_bytes[k]);
      if (fused_after_exchange || fused_in_pipeline) {
        t = std::max(t, ends[k]) + step + gather;
      } else {
        t = std::max({t, ends[k], makespan}) + step + gather;
      }
    }
    last = std::max(last, t);
  }
  return last;
}

}  // namespace stagewise::detail
