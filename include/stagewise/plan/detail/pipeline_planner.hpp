#pragma once

// plan_pipeline's work (plan/plan_pipeline.hpp): the candidates it weighs (micro-batch counts,
// schedules and splits from plan_candidates.hpp, the fused step or not), each stage profiled
// alone (profile_stages, its optimizer step from optimizer_step_seconds.hpp), each
// candidate's checkpoint modes and offloads searched (plan_search.hpp), and the plan assembled
// from the one chosen, with every candidate as a plan of its own.

#include "stagewise/core/batch.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/plan/detail/optimizer_step_seconds.hpp"
#include "stagewise/plan/detail/plan_candidates.hpp"
#include "stagewise/plan/detail/plan_search.hpp"
#include "stagewise/plan/detail/stage_states.hpp"
#include "stagewise/plan/pipeline_plan.hpp"
#include "stagewise/plan/plan_options.hpp"
#include "stagewise/plan/stage_costs.hpp"
#include "stagewise/runtime/cell_runs.hpp"
#include "stagewise/schedule/choose.hpp"
#include "stagewise/stage/block_partition.hpp"
#include "stagewise/stage/profile.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::detail {

inline std::string mib(double bytes) {
  std::ostringstream s;
  s.precision(4);
  s << bytes / (1 << 20) << " MiB";
  return s.str();
}

// One candidate weighed: its best setting of the stages' choices and what it was.
struct PlanFound {
  schedule::detail::MemoryCandidate weighed;
  PlanCandidate candidate;
  const schedule::ScheduleCandidate* sched = nullptr;
  int m = 1;
  std::string split_by;
  balance split;
  bool fused = false;
  schedule::OffloadCosts copies;
  bool stable = false;  // its split is the split by size, which no run's timings change
  std::vector<double> state_shares;  // per stage, optimizer state off the device (empty: none)
};

// What planners of one model share (ranks(N) runs one per factorisation): the layers' profiles
// per micro-batch size, each split's stage costs per size, and the layers' optimizer steps.
struct ProfileCache {
  std::map<std::int64_t, std::pair<std::vector<double>, std::vector<double>>> layers;
  std::map<std::pair<std::int64_t, balance>, std::vector<StageCosts>> stages;
  std::vector<double> layer_steps;
  std::vector<double> layer_host_steps;
};

// The search of plan_pipeline over every candidate; `plan()` chooses.
class PipelinePlanner {
 public:
  PipelinePlanner(const torch::nn::Sequential& model, const Batch& batch,
                  const torch::Tensor& target, const runtime::loss_fn_t& loss_fn,
                  const PlanOptions& options, ProfileCache* cache = nullptr)
      : model_(model), batch_(batch), target_(target), loss_fn_(loss_fn), options_(options),
        cache_(cache != nullptr ? cache : &own_cache_) {
    TORCH_CHECK(options.memory_per_worker() > 0, who_,
                ": give the bytes each worker may hold: PlanOptions().memory_per_worker(bytes)");
    check_sample(batch, who_);
    rows_ = batch[0].size(0);
    usable_ = static_cast<double>(options.memory_per_worker()) * (1.0 - options.headroom());
    profiling_ = BalanceOptions().rounds(options.rounds());
    if (options.device()) profiling_.device(*options.device());
    schedules_ = plan_schedules(options);
    if (cache_->layer_steps.empty()) cache_->layer_steps = layer_step_seconds(model, options);
    layer_steps_ = cache_->layer_steps;
    if (options.optimizer_store()) {
      if (cache_->layer_host_steps.empty()) {
        cache_->layer_host_steps = layer_host_step_seconds(model, options, layer_steps_);
      }
      layer_host_steps_ = cache_->layer_host_steps;
    }
    if (!options.fused_step() || !*options.fused_step()) fused_choices_.push_back(false);
    if (!options.fused_step() || *options.fused_step()) fused_choices_.push_back(true);
  }

  // Weighs every candidate with `m` micro-batches: profiles the layers on one micro-batch, and
  // each split's stages once.
  void weigh_micro_batches(int m) {
    const Batch sample = first_rows(batch_, rows_ / m);
    auto& layers = cache_->layers[rows_ / m];
    if (layers.first.empty()) {
      layers.first = profile_times(model_, sample, profiling_);
      layers.second = profile_sizes(
          model_, sample, BalanceOptions(profiling_).param_scale(2.0 + options_.state_per_param()));
    }
    const auto& times = layers.first;
    const auto& sizes = layers.second;
    std::map<int, std::vector<std::pair<std::string, balance>>> splits;
    std::map<balance, std::vector<StageCosts>> costs;
    for (const auto& sc : schedules_) {
      const int n = options_.workers() * sc.stages_per_worker;
      if (n > static_cast<int>(model_->size())) {
        skip(sc.schedule.name() + ": needs " + std::to_string(n) + " stages, the model has " +
             std::to_string(model_->size()) + " layers");
        continue;
      }
      if (!splits.count(n)) splits[n] = splits_of(times, sizes, n);
      const auto by_size = block_sizes(sizes, n);
      for (const auto& [by, split] : splits[n]) {
        const bool stable = std::equal(split.begin(), split.end(), by_size.begin(), by_size.end());
        if (!costs.count(split)) {
          auto& cached = cache_->stages[{rows_ / m, split}];
          if (cached.empty()) {
            StageLoss loss;
            if (loss_fn_ && target_.defined()) loss = {loss_fn_, target_.narrow(0, 0, rows_ / m)};
            cached = profile_stages(model_, split, sample, profiling_, loss);
          }
          costs[split] = cached;
        }
        for (bool fused : fused_choices_) {
          weigh_state_shares(sc, m, by, split, costs[split], fused, stable);
        }
      }
    }
  }

  // The fastest candidate that fits (or the smallest), as a plan with every candidate.
  PipelinePlan plan() {
    TORCH_CHECK(!found_.empty(), who_, ": no candidate could be planned for ", options_.workers(),
                " workers: ", skipped_.empty() ? std::string("none given") : skipped_.front(),
                "; give fewer workers or a model with more layers");
    const bool for_memory = options_.prefer() == PlanFor::memory;
    std::stable_sort(found_.begin(), found_.end(), [&](const PlanFound& a, const PlanFound& b) {
      if (for_memory && a.weighed.peak != b.weighed.peak) return a.weighed.peak < b.weighed.peak;
      return a.weighed.weight.time < b.weighed.weight.time;
    });
    const PlanFound* chosen = nullptr;
    for (const auto& f : found_) {
      if (!chosen && f.candidate.fits) chosen = &f;
    }
    TORCH_CHECK(chosen != nullptr, refusal());
    PipelinePlan out = plan_of(*chosen);
    for (const auto& f : found_) {
      out.candidates.push_back(f.candidate);
      out.candidates.back().plan = std::make_shared<const PipelinePlan>(plan_of(f));
    }
    for (const auto& s : skipped_) out.candidates.push_back({s, 0, 0, false, "not weighed", nullptr});
    return out;
  }

 private:
  // Why nothing fits: the smallest cap a candidate every run weighs fits (on the split by size:
  // the bytes are the same in every run, the times, and so the split by time, are not), and
  // this run's smaller one on a split by time, if any.
  std::string refusal() const {
    const double inf = std::numeric_limits<double>::infinity();
    double stable = inf, any = inf;
    for (const auto& f : found_) {
      const double cap = f.weighed.peak / (1.0 - options_.headroom());
      any = std::min(any, cap);
      if (f.stable) stable = std::min(stable, cap);
    }
    if (stable == inf) stable = any;
    std::ostringstream out;
    out << who_ << ": nothing fits " << mib(static_cast<double>(options_.memory_per_worker()))
        << " per worker on " << options_.workers() << " workers (headroom " << options_.headroom()
        << " included); the smallest cap any candidate fits is "
        << static_cast<std::int64_t>(std::ceil(stable)) << " bytes (" << mib(stable) << ")";
    if (any < stable) {
      out << "; in this run a split by time fits " << static_cast<std::int64_t>(std::ceil(any))
          << " bytes, but another run's timings may split otherwise";
    }
    out << ". Give at least that, or "
        << (options_.store() ? "" : "a store to offload to (PlanOptions().store(...)), ")
        << "more workers, or a smaller batch";
    return out.str();
  }

  void skip(const std::string& why) {
    if (std::find(skipped_.begin(), skipped_.end(), why) == skipped_.end()) skipped_.push_back(why);
  }

  // The search's input for one candidate.
  SearchInput input(const schedule::ScheduleCandidate& sc, int m, const balance& split,
                    const std::vector<StageCosts>& costs, bool fused) const {
    SearchInput in;
    in.sched = &sc.schedule;
    in.stages = static_cast<int>(split.size());
    in.micro_batches = m;
    in.costs = &costs;
    in.state = stage_states(costs, options_);
    std::size_t first = 0;
    for (auto layers : split) {
      double t = 0;
      for (std::size_t l = first; l < first + static_cast<std::size_t>(layers); ++l) t += layer_steps_[l];
      in.step_seconds.push_back(t);
      first += static_cast<std::size_t>(layers);
    }
    // With replicas the fused step runs after the reduction, at the step's end, as an unfused
    // step (and a sharded one steps the replica's shard: about 1/d of the time).
    in.fused = fused && options_.replicas() == 1;
    if (options_.shard_optimizer_state()) {
      for (auto& t : in.step_seconds) t /= options_.replicas();
    }
    if (options_.ranks() > 0) {  // the step as the ranks run it, with the replicas' exchange
      ReplicaExchange x{.replicas = options_.replicas(),
                        .shard_optimizer_state = options_.shard_optimizer_state(),
                        .shard_gradients = options_.shard_gradients(),
                        .bucket_bytes = static_cast<double>(options_.bucket_bytes()),
                        .link = options_.link().value_or(LinkSpeed{}),
                        .grad_bytes = {}};
      for (const auto& c : costs) {
        x.grad_bytes.push_back(c.param_bytes);
        // One message each way between neighbouring stages' ranks: a micro-batch's activation
        // forward and its gradient back. A message through the pipe's transport costs about two
        // of the link's latencies (the sender's hand-off and the receiver's wake-up; a transport
        // round trip is 0.34-0.48 ms where Gloo's own is 0.1 ms, docs/benchmarks.md).
        const double message = 2 * x.link.latency_seconds;
        in.receive_input.push_back(message + c.input_bytes / x.link.bytes_per_second);
        in.receive_grad.push_back(message + c.output_bytes / x.link.bytes_per_second);
      }
      in.exchange = std::move(x);
      in.fused_after_exchange = fused && options_.replicas() > 1;
    }
    in.may_offload = options_.store().has_value();
    in.store_speed = options_.store_speed();
    in.cap = usable_;
    in.separate_devices = options_.separate_devices();
    return in;
  }

  // Weighs one candidate with its optimizer state on the device and, with an optimizer store,
  // with shares of it off: the stages of every worker over the cap go none, half, all, until it
  // fits or all are off; and half and all on every stage.
  void weigh_state_shares(const schedule::ScheduleCandidate& sc, int m, const std::string& by,
                          const balance& split, const std::vector<StageCosts>& costs, bool fused,
                          bool stable) {
    if (!options_.optimizer_store()) {
      weigh(sc, m, by, split, costs, fused, stable, {});
      return;
    }
    const auto n = split.size();
    std::vector<std::vector<double>> tried;
    auto weigh_once = [&](const std::vector<double>& shares) -> const PlanFound* {
      if (std::find(tried.begin(), tried.end(), shares) != tried.end()) return nullptr;
      tried.push_back(shares);
      const auto before = found_.size();
      weigh(sc, m, by, split, costs, fused, stable, shares);
      return found_.size() > before ? &found_.back() : nullptr;
    };
    std::vector<double> shares(n, 0.0);
    for (const PlanFound* f = weigh_once(shares); f != nullptr && !f->candidate.fits;) {
      const auto& plan = f->weighed.plan;
      bool raised = false;
      for (int w = 0; w < plan.workers; ++w) {
        if (f->weighed.weight.peaks[static_cast<std::size_t>(w)] <= usable_) continue;
        for (int j : plan.stages_of(w)) {
          auto& s = shares[static_cast<std::size_t>(j)];
          if (s < 1.0) {
            s = next_share(s);
            raised = true;
          }
        }
      }
      if (!raised) break;
      f = weigh_once(shares);
    }
    for (double uniform : {0.5, 1.0}) weigh_once(std::vector<double>(n, uniform));
  }

  // The stages of `split` with `shares` of their optimizer state off the device: what each
  // holds and its step's device and host parts (state_offload_plan.hpp).
  void apply_state_shares(SearchInput& in, const balance& split,
                          const std::vector<double>& shares) const {
    const auto layers = model_->children();
    std::size_t first = 0;
    for (std::size_t j = 0; j < split.size(); ++j) {
      StateOffloadStage stage;
      for (std::size_t l = first; l < first + static_cast<std::size_t>(split[j]); ++l) {
        for (const auto& p : layers[l]->parameters()) {
          if (p.requires_grad()) stage.param_bytes.push_back(static_cast<std::int64_t>(p.nbytes()));
        }
        stage.host_step += layer_host_steps_[l];
      }
      first += static_cast<std::size_t>(split[j]);
      stage.device_step = in.step_seconds[j];
      stage.state_per_param = options_.state_per_param();
      stage.step_temporaries = options_.step_temporaries();
      stage.speed = options_.optimizer_store_speed();
      const auto o = offloaded_stage(stage, shares[j]);
      in.state[j] = o.state;
      in.step_seconds[j] = o.device_step;
      in.host_seconds.push_back(o.host_seconds);
    }
  }

  // Searches one candidate's checkpoint modes and offloads, and records what it found.
  void weigh(const schedule::ScheduleCandidate& sc, int m, const std::string& by,
             const balance& split, const std::vector<StageCosts>& costs, bool fused, bool stable,
             const std::vector<double>& shares) {
    SearchInput in = input(sc, m, split, costs, fused);
    if (!shares.empty()) apply_state_shares(in, split, shares);
    schedule::PlanCache plans;
    schedule::detail::MemoryCandidate w;
    try {
      w = search_choices(in, options_.prefer() == PlanFor::memory, plans);
    } catch (const std::exception& e) {
      skip(sc.schedule.name() + " with " + std::to_string(m) + " micro-batches: cannot run (" +
           message_of(e) + ")");
      return;
    }
    PlanCandidate cand;
    std::ostringstream d;
    d << sc.schedule.name() << ", " << m << " micro-batches, split by " << by << " {";
    for (std::size_t j = 0; j < split.size(); ++j) d << (j ? "," : "") << split[j];
    d << "}, " << schedule::detail::describe(w.choices) << ", " << (fused ? "fused" : "unfused")
      << " step";
    if (!shares.empty()) d << ", optimizer state off the device: " << describe_shares(shares);
    cand.description = d.str();
    cand.step_seconds = w.weight.time;
    cand.peak = w.peak;
    cand.fits = w.peak <= usable_;
    if (!cand.fits) {
      cand.why_not = "peak " + mib(w.peak) + " over " + mib(usable_) + " (the cap less its headroom)";
    }
    found_.push_back(
        {std::move(w), cand, &sc, m, by, split, fused, offload_costs_for(in), stable, shares});
  }

  PipelinePlan plan_of(const PlanFound& f) const {
    PipelinePlan plan;
    plan.split = f.split;
    plan.split_by = f.split_by;
    plan.schedule = f.sched->schedule;
    plan.stages_per_worker = f.sched->stages_per_worker;
    plan.workers = options_.workers();
    plan.micro_batches = f.m;
    plan.batch_rows = rows_;
    for (const auto& c : f.weighed.choices) {
      plan.checkpoints.push_back(c.mode);
      plan.offload_stages.push_back(c.offload && f.weighed.moves);
    }
    plan.store = options_.store();  // kept when unused: a rank may take another's plan
    plan.offload_costs = f.copies;
    plan.fused_step = f.fused;
    plan.optimizer_shares = f.state_shares;
    plan.optimizer_store = options_.optimizer_store();
    plan.optimizer = options_.optimizer_name();
    plan.replicas = options_.replicas();
    plan.shard_optimizer_state = options_.shard_optimizer_state();
    plan.shard_gradients = options_.shard_gradients();
    plan.cap = options_.memory_per_worker();
    plan.step_seconds = f.weighed.weight.time;
    plan.memory = f.weighed.weight.memory;
    return plan;
  }

  const char* who_ = "stagewise::plan_pipeline";
  const torch::nn::Sequential& model_;
  const Batch& batch_;
  const torch::Tensor& target_;
  const runtime::loss_fn_t& loss_fn_;
  const PlanOptions& options_;
  ProfileCache own_cache_;
  ProfileCache* cache_;
  std::int64_t rows_ = 0;
  double usable_ = 0;  // the cap less its headroom: what a plan's peak may reach
  BalanceOptions profiling_;
  std::vector<schedule::ScheduleCandidate> schedules_;
  std::vector<double> layer_steps_;
  std::vector<double> layer_host_steps_;  // with an optimizer store: each layer's step on the host
  std::vector<bool> fused_choices_;
  std::vector<PlanFound> found_;
  std::vector<std::string> skipped_;  // why a schedule was not weighed (once each)
};

}  // namespace stagewise::detail
