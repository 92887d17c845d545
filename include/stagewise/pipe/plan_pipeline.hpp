#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/pipe/detail/plan_search.hpp"
#include "stagewise/pipe/plan_options.hpp"
#include "stagewise/pipe/pipeline_plan.hpp"
#include "stagewise/runtime/cell_runs.hpp"
#include "stagewise/schedule/choose.hpp"
#include "stagewise/stage/block_partition.hpp"
#include "stagewise/stage/profile.hpp"
#include "stagewise/stage/stage_costs.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

namespace detail {

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

// One optimizer step's time on copies of `params` (each with a gradient), the second of two (the
// first makes the state).
inline double optimizer_step_seconds(const PlanOptions& o, const std::vector<torch::Tensor>& params) {
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> copies;
  for (const auto& p : params) {
    auto c = p.detach().clone().requires_grad_(true);
    c.mutable_grad() = torch::randn_like(c);
    copies.push_back(c);
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o.adam()) {
    opt = std::make_unique<torch::optim::Adam>(
        copies, torch::optim::AdamOptions(o.adam()->lr).weight_decay(o.adam()->weight_decay));
  } else {
    opt = std::make_unique<torch::optim::SGD>(
        copies, torch::optim::SGDOptions(o.sgd()->lr).momentum(o.sgd()->momentum));
  }
  torch::NoGradGuard no_grad;
  opt->step();
  const auto t0 = std::chrono::steady_clock::now();
  opt->step();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Each layer's optimizer step time (summed per stage later).
inline std::vector<double> layer_step_seconds(const torch::nn::Sequential& model,
                                              const PlanOptions& o) {
  std::vector<double> out;
  for (const auto& layer : model->children()) out.push_back(optimizer_step_seconds(o, layer->parameters()));
  return out;
}

// What each stage holds besides its cells, from its costs and the optimizer.
inline std::vector<schedule::StageState> stage_states(const std::vector<StageCosts>& costs,
                                                      const PlanOptions& o) {
  std::vector<schedule::StageState> out;
  for (const auto& c : costs) {
    out.push_back({.params = c.param_bytes,
                   .grads = c.param_bytes,
                   .optimizer = o.state_per_param() * c.param_bytes,
                   .step_working = o.step_temporaries() * c.largest_param_bytes});
  }
  return out;
}

inline std::string mib(double bytes) {
  std::ostringstream s;
  s.precision(4);
  s << bytes / (1 << 20) << " MiB";
  return s.str();
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

}  // namespace detail

/// The fastest pipeline for `model` on `batch` (one mini-batch: a tensor or a tuple, rows along
/// dimension 0), trained on `target` with `loss_fn` as `train_step` is, that fits `options.memory_per_worker()` bytes on each of `options.workers()`
/// workers, counting everything a worker holds: its stages' parameters, their gradients, the
/// optimizer's state, the activations its cells keep across the schedule, and its largest
/// action's working memory. It weighs every micro-batch count (the divisors of the batch's rows),
/// every built-in schedule (one stage per worker, or two for the V-shaped and interleaved ones),
/// two splits (the exact min-max split of the layers' profiled times, and of their sizes), each
/// stage's checkpoint mode and offload (with `options.store()`), and the optimizer step fused
/// into backward or not; each candidate is planned and simulated once on costs profiled on
/// copies of the model (`profile_stages`). Returns the fastest that fits (or, with
/// `prefer(PlanFor::memory)`, the smallest), with `report()`. When nothing fits, the error names
/// the smallest cap that would, and what else would help. The model is left as it was.
///   auto plan = sw::plan_pipeline(model, x, y, loss_fn,
///                                 sw::PlanOptions().workers(4).memory_per_worker(6LL << 30));
///   auto pipe = sw::Pipe(model, plan);
///   pipe->train_step(x, y, loss_fn);           // the planned schedule
inline PipelinePlan plan_pipeline(const torch::nn::Sequential& model, const Batch& batch,
                                  const torch::Tensor& target, const runtime::loss_fn_t& loss_fn,
                                  const PlanOptions& options) {
  const char* who = "stagewise::plan_pipeline";
  TORCH_CHECK(options.memory_per_worker() > 0, who,
              ": give the bytes each worker may hold: PlanOptions().memory_per_worker(bytes)");
  detail::check_sample(batch, who);
  const std::int64_t rows = batch[0].size(0);
  const int k = options.workers();
  const auto cap = static_cast<double>(options.memory_per_worker());
  const double usable = cap * (1.0 - options.headroom());  // what a plan's peak may reach
  BalanceOptions profiling = BalanceOptions().rounds(options.rounds());
  if (options.device()) profiling.device(*options.device());
  const auto schedules = detail::plan_schedules(options);
  const auto layer_steps = detail::layer_step_seconds(model, options);
  const bool for_memory = options.prefer() == PlanFor::memory;
  std::vector<bool> fused_choices;
  if (!options.fused_step() || !*options.fused_step()) fused_choices.push_back(false);
  if (!options.fused_step() || *options.fused_step()) fused_choices.push_back(true);

  struct Found {
    schedule::detail::MemoryCandidate weighed;
    PlanCandidate candidate;
    const schedule::ScheduleCandidate* sched;
    int m;
    std::string split_by;
    balance split;
    bool fused;
    schedule::OffloadCosts copies;
  };
  std::vector<Found> found;
  std::vector<std::string> skipped;  // why a schedule was not weighed (once each)
  auto skip = [&](const std::string& why) {
    if (std::find(skipped.begin(), skipped.end(), why) == skipped.end()) skipped.push_back(why);
  };
  for (int m : detail::micro_batch_counts(options, rows)) {
    const Batch sample = detail::first_rows(batch, rows / m);
    const auto times = profile_times(model, sample, profiling);
    const auto sizes = profile_sizes(
        model, sample, BalanceOptions(profiling).param_scale(2.0 + options.state_per_param()));
    std::map<int, std::vector<std::pair<std::string, balance>>> splits;
    std::map<balance, std::vector<StageCosts>> costs;
    for (const auto& sc : schedules) {
      const int n = k * sc.stages_per_worker;
      if (n > static_cast<int>(model->size())) {
        skip(sc.schedule.name() + ": needs " + std::to_string(n) +
                          " stages, the model has " + std::to_string(model->size()) + " layers");
        continue;
      }
      if (!splits.count(n)) splits[n] = detail::splits_of(times, sizes, n);
      for (const auto& [by, split] : splits[n]) {
        if (!costs.count(split)) {
          StageLoss loss;
          if (loss_fn && target.defined()) loss = {loss_fn, target.narrow(0, 0, rows / m)};
          costs[split] = profile_stages(model, split, sample, profiling, loss);
        }
        const auto& c = costs[split];
        for (bool fused : fused_choices) {
          detail::SearchInput in;
          in.sched = &sc.schedule;
          in.stages = n;
          in.micro_batches = m;
          in.costs = &c;
          in.state = detail::stage_states(c, options);
          std::size_t first = 0;
          for (auto layers : split) {
            double t = 0;
            for (std::size_t l = first; l < first + static_cast<std::size_t>(layers); ++l) t += layer_steps[l];
            in.step_seconds.push_back(t);
            first += static_cast<std::size_t>(layers);
          }
          in.fused = fused;
          in.may_offload = options.store().has_value();
          in.store_speed = options.store_speed();
          in.cap = usable;
          in.separate_devices = options.separate_devices();
          schedule::PlanCache plans;
          schedule::detail::MemoryCandidate w;
          try {
            w = detail::search_choices(in, for_memory, plans);
          } catch (const std::exception& e) {
            skip(sc.schedule.name() + " with " + std::to_string(m) +
                              " micro-batches: cannot run (" + ::stagewise::detail::message_of(e) + ")");
            continue;
          }
          PlanCandidate cand;
          std::ostringstream d;
          d << sc.schedule.name() << ", " << m << " micro-batches, split by " << by << " {";
          for (std::size_t j = 0; j < split.size(); ++j) d << (j ? "," : "") << split[j];
          d << "}, " << schedule::detail::describe(w.choices) << ", " << (fused ? "fused" : "unfused") << " step";
          cand.description = d.str();
          cand.step_seconds = w.weight.time;
          cand.peak = w.peak;
          cand.fits = w.peak <= usable;
          if (!cand.fits) {
            cand.why_not = "peak " + detail::mib(w.peak) + " over " + detail::mib(usable) +
                           " (the cap less its headroom)";
          }
          found.push_back({std::move(w), cand, &sc, m, by, split, fused,
                           detail::offload_costs_for(in)});
        }
      }
    }
  }
  TORCH_CHECK(!found.empty(), who, ": no candidate could be planned for ", k, " workers: ",
              skipped.empty() ? std::string("none given") : skipped.front(),
              "; give fewer workers or a model with more layers");
  std::stable_sort(found.begin(), found.end(), [&](const Found& a, const Found& b) {
    if (for_memory && a.weighed.peak != b.weighed.peak) return a.weighed.peak < b.weighed.peak;
    return a.weighed.weight.time < b.weighed.weight.time;
  });
  const Found* chosen = nullptr;
  double smallest = std::numeric_limits<double>::infinity();
  for (const auto& f : found) {
    smallest = std::min(smallest, f.weighed.peak / (1.0 - options.headroom()));
    if (!chosen && f.candidate.fits) chosen = &f;
  }
  TORCH_CHECK(chosen != nullptr, who, ": nothing fits ", detail::mib(cap), " per worker on ", k,
              " workers (headroom ", options.headroom(), " included); the smallest cap any "
              "candidate fits is ",
              static_cast<std::int64_t>(std::ceil(smallest)), " bytes (", detail::mib(smallest),
              "). Give at least that, or ",
              options.store() ? "" : "a store to offload to (PlanOptions().store(...)), ",
              "more workers, or a smaller batch");
  auto plan_of = [&](const Found& f) {
    PipelinePlan plan;
    plan.split = f.split;
    plan.split_by = f.split_by;
    plan.schedule = f.sched->schedule;
    plan.stages_per_worker = f.sched->stages_per_worker;
    plan.workers = k;
    plan.micro_batches = f.m;
    plan.batch_rows = rows;
    for (const auto& c : f.weighed.choices) {
      plan.checkpoints.push_back(c.mode);
      plan.offload_stages.push_back(c.offload && f.weighed.moves);
    }
    if (f.weighed.moves) plan.store = options.store();
    plan.offload_costs = f.copies;
    plan.fused_step = f.fused;
    plan.optimizer = options.optimizer_name();
    plan.cap = options.memory_per_worker();
    plan.step_seconds = f.weighed.weight.time;
    plan.memory = f.weighed.weight.memory;
    return plan;
  };
  PipelinePlan plan = plan_of(*chosen);
  for (const auto& f : found) {
    plan.candidates.push_back(f.candidate);
    plan.candidates.back().plan = std::make_shared<const PipelinePlan>(plan_of(f));
  }
  for (const auto& s : skipped) plan.candidates.push_back({s, 0, 0, false, "not weighed", nullptr});
  return plan;
}

/// plan_pipeline without the loss: the last stage is profiled back-propagating gradients of ones
/// from its output, so what the loss keeps and makes (e.g. a cross entropy's log-probabilities,
/// the size of the output) is not counted; give the target and the loss to count it.
inline PipelinePlan plan_pipeline(const torch::nn::Sequential& model, const Batch& batch,
                                  const PlanOptions& options) {
  return plan_pipeline(model, batch, torch::Tensor(), nullptr, options);
}

}  // namespace stagewise
