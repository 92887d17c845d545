#pragma once

// plan_pipeline with PlanOptions().ranks(N): every factorisation N = K x d (K ranks per
// replica's pipeline, d replicas, each on rows/d of the batch) and, for d > 1, each sharding of
// the replicas' state, weighed by a PipelinePlanner of its own over profiles they share
// (ProfileCache: each micro-batch size profiled once); the fastest fitting candidate of all (or
// the smallest) is the plan, with every factorisation's best and every candidate.

#include "stagewise/core/batch.hpp"
#include "stagewise/plan/detail/pipeline_planner.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/plan/plan_options.hpp"
#include "stagewise/runtime/cell_runs.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace stagewise::detail {

// One factorisation and sharding to weigh.
struct RankShape {
  int stage_ranks = 1;
  int replicas = 1;
  bool shard_state = false;
  bool shard_grads = false;
};

// Every K x d = n (deepest first), and for d > 1 the three shardings.
inline std::vector<RankShape> rank_shapes(int n) {
  std::vector<RankShape> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    out.push_back({n / d, d, false, false});
    if (d > 1) {
      out.push_back({n / d, d, true, false});
      out.push_back({n / d, d, true, true});
    }
  }
  return out;
}

// "2 x 2, sharding optimizer state": a candidate's factorisation, for its description.
inline std::string shape_name(const RankShape& s) {
  return std::to_string(s.stage_ranks) + " x " + std::to_string(s.replicas) + ", sharding " +
         PipelinePlan::sharding_name(s.shard_state, s.shard_grads);
}

// The first `rows` rows of the target (undefined stays undefined).
inline torch::Tensor first_target_rows(const torch::Tensor& target, std::int64_t rows) {
  return target.defined() ? target.narrow(0, 0, rows) : target;
}

// What plan_for_ranks refuses before it profiles anything: replicas or sharding set by hand, no
// cap, a bad sample, replicas weighed without a link.
inline void check_ranks_options(const PlanOptions& options, const Batch& batch,
                                const std::vector<RankShape>& shapes) {
  const char* who = "stagewise::plan_pipeline";
  const int n = options.ranks();
  TORCH_CHECK(options.replicas() == 1 && !options.shard_optimizer_state(), who, ": ranks(", n,
              ") weighs the replicas and their sharding itself; leave out replicas(",
              options.replicas(),
              ") and the sharding setters, or plan one replica with "
              "workers(K).replicas(d)");
  TORCH_CHECK(options.memory_per_worker() > 0, who,
              ": give the bytes each rank may hold: PlanOptions().memory_per_worker(bytes)");
  check_sample(batch, who);
  if (!options.link() && n > 1) {
    std::string with;
    for (const auto& s : shapes) {
      if (s.replicas > 1 && !s.shard_state) {
        with += (with.empty() ? "" : ", ") + std::to_string(s.stage_ranks) + " x " +
                std::to_string(s.replicas);
      }
    }
    TORCH_CHECK(false, who, ": ranks(", n, ") weighs replicas (", with,
                " ranks per pipeline x replicas), whose gradient exchange is costed from the "
                "link's speed, and none was given: give PlanOptions().link(sw::LinkSpeed{...}), "
                "or measure the job's with sw::distributed::measure_link(job)");
  }
}

// One factorisation `s` of the ranks weighed: its best plan appended to `plans` when one fits,
// and what it was (or why not) in the factorisation's row.
inline PlanFactorisation weigh_factorisation(const torch::nn::Sequential& model, const Batch& batch,
                                             const torch::Tensor& target,
                                             const runtime::loss_fn_t& loss_fn,
                                             const PlanOptions& options, const RankShape& s,
                                             ProfileCache& cache, std::vector<PipelinePlan>& plans) {
  PlanFactorisation f;
  f.stage_ranks = s.stage_ranks;
  f.replicas = s.replicas;
  f.sharding = PipelinePlan::sharding_name(s.shard_state, s.shard_grads);
  const auto rows = batch[0].size(0);
  if (rows % s.replicas != 0) {
    f.why_not = "not weighed: the batch's " + std::to_string(rows) + " rows do not split into " +
                std::to_string(s.replicas) + " replicas";
    return f;
  }
  PlanOptions o = options;
  o.workers(s.stage_ranks).replicas(s.replicas).separate_devices(true);
  o.shard_optimizer_state(s.shard_state).shard_gradients(s.shard_grads);
  const auto replica_rows = rows / s.replicas;
  const Batch part = first_rows(batch, replica_rows);
  const torch::Tensor part_target = first_target_rows(target, replica_rows);
  try {
    PipelinePlanner planner(model, part, part_target, loss_fn, o, &cache);
    for (int m : micro_batch_counts(o, replica_rows)) planner.weigh_micro_batches(m);
    auto plan = planner.plan();
    f.step_seconds = plan.step_seconds;
    f.peak = plan.peak();
    f.fits = true;
    f.best = plan.candidates.empty() ? "" : plan.candidates.front().description;
    for (const auto& c : plan.candidates) {
      if (c.fits) {
        f.best = c.description;
        break;
      }
    }
    plans.push_back(std::move(plan));
  } catch (const std::exception& e) {
    f.why_not = message_of(e);
  }
  return f;
}

// Orders two plans (step seconds, peak bytes): the faster, or, preferring memory, the smaller.
struct RanksOrder {
  bool for_memory = false;
  bool operator()(double t1, double p1, double t2, double p2) const {
    if (for_memory && p1 != p2) return p1 < p2;
    return t1 < t2;
  }
};

// Every factorisation's candidates, each as a plan for the `n` ranks, best first.
inline std::vector<PlanCandidate> ranks_candidates(const std::vector<PipelinePlan>& plans, int n,
                                                   const std::optional<LinkSpeed>& link,
                                                   RanksOrder better) {
  std::vector<PlanCandidate> out;
  for (const auto& plan : plans) {
    const RankShape s{plan.workers, plan.replicas, plan.shard_optimizer_state,
                      plan.shard_gradients};
    for (auto c : plan.candidates) {
      c.description = shape_name(s) + ": " + c.description;
      if (c.plan) {
        auto p = std::make_shared<PipelinePlan>(*c.plan);
        p->ranks = n;
        p->link = link;
        c.plan = std::move(p);
      }
      out.push_back(std::move(c));
    }
  }
  std::stable_sort(out.begin(), out.end(), [&](const PlanCandidate& a, const PlanCandidate& b) {
    if (!a.plan || !b.plan) return a.plan && !b.plan;
    return better(a.step_seconds, a.peak, b.step_seconds, b.peak);
  });
  return out;
}

// The factorisations' rows for the report: those that fit by their best, then those that did not
// fit or were not weighed; each that fits but lost says why against `chosen`.
inline std::vector<PlanFactorisation> ranks_rows(std::vector<PlanFactorisation> weighed,
                                                 const PipelinePlan& chosen, RanksOrder better) {
  std::stable_sort(weighed.begin(), weighed.end(), [&](const auto& a, const auto& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits && better(a.step_seconds, a.peak, b.step_seconds, b.peak);
  });
  const auto sharding =
      PipelinePlan::sharding_name(chosen.shard_optimizer_state, chosen.shard_gradients);
  for (auto& f : weighed) {
    const bool is_chosen = f.stage_ranks == chosen.workers && f.replicas == chosen.replicas &&
                           f.sharding == sharding;
    if (f.fits && !is_chosen) {
      f.why_not = better.for_memory ? "a larger peak than the chosen" : "slower than the chosen";
    }
  }
  return weighed;
}

// plan_pipeline for options.ranks() ranks; `shared`, when given, keeps the profiles across calls
// (two plans of one model on one profile: the tests compare links on equal costs).
inline PipelinePlan plan_for_ranks(const torch::nn::Sequential& model, const Batch& batch,
                                   const torch::Tensor& target, const runtime::loss_fn_t& loss_fn,
                                   const PlanOptions& options, ProfileCache* shared = nullptr) {
  const int n = options.ranks();
  const auto shapes = rank_shapes(n);
  check_ranks_options(options, batch, shapes);
  ProfileCache own;
  ProfileCache& cache = shared != nullptr ? *shared : own;
  std::vector<PipelinePlan> plans;
  std::vector<PlanFactorisation> weighed;
  for (const auto& s : shapes) {
    weighed.push_back(weigh_factorisation(model, batch, target, loss_fn, options, s, cache, plans));
  }
  if (plans.empty()) {
    std::string why;
    for (const auto& f : weighed) {
      why += "\n  " + std::to_string(f.stage_ranks) + " x " + std::to_string(f.replicas) +
             ", sharding " + f.sharding + ": " + f.why_not;
    }
    TORCH_CHECK(false, "stagewise::plan_pipeline: no factorisation of ", n, " ranks fits ",
                options.memory_per_worker(), " bytes per rank:", why);
  }
  const RanksOrder better{options.prefer() == PlanFor::memory};
  std::size_t best = 0;
  for (std::size_t i = 1; i < plans.size(); ++i) {
    if (better(plans[i].step_seconds, plans[i].peak(), plans[best].step_seconds,
               plans[best].peak())) {
      best = i;
    }
  }
  PipelinePlan out = plans[best];
  out.candidates = ranks_candidates(plans, n, options.link(), better);
  out.factorisations = ranks_rows(std::move(weighed), out, better);
  out.ranks = n;
  out.link = options.link();
  return out;
}

}  // namespace stagewise::detail
