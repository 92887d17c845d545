#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/runtime/split_backward.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/skip/tracker.hpp"
#include "stagewise/stage/detail/device_bytes.hpp"
#include "stagewise/stage/partition.hpp"
#include "stagewise/stage/profile.hpp"

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {

/// What one micro-batch costs one stage, measured by running the stage alone (`profile_stages`):
/// the time of its forward (F, and a recompute), whole backward (B), input-gradient pass (I)
/// and weight-gradient pass (W), in seconds; the bytes a cell holds (`schedule::CellBytes`, for a
/// whole backward and for a split one); and the bytes of its input, output and parameters.
struct StageCosts {
  double forward = 0;     ///< F (and R), seconds
  double backward = 0;    ///< B
  double input_grad = 0;  ///< I
  double weight_grad = 0; ///< W
  /// Kept from F to B, and B's working memory (a whole backward).
  schedule::CellBytes whole;
  /// Kept from F to I, from I to W, and I's and W's working memory (a split backward).
  schedule::CellBytes split;
  /// A cell's inputs (the stage's input and the skips it pops): what a checkpointed cell keeps.
  double input_bytes = 0;
  /// The stage's output (the next stage's input).
  double output_bytes = 0;
  /// The stage's parameters.
  double param_bytes = 0;
  /// The largest parameter (an optimizer step's temporaries are about its size).
  double largest_param_bytes = 0;
  /// Each parameter's bytes, in the stage's order (what data-parallel replicas shard it by:
  /// `optim::shard_owners`).
  std::vector<double> tensor_bytes;
};

/// The loss a pipe's last stage computes, for `profile_stages`: `fn(output, target)` on one
/// micro-batch's target (none: the last stage's backward starts from gradients of ones on its
/// output, and what the loss itself keeps and makes is not counted).
struct StageLoss {
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> fn;
  torch::Tensor target;
};

namespace detail {

// A copy of `t` that is a leaf of its own, requiring grad when floating point and `grad`: what a
// pipe's cell takes as its input (a split backward finds its inputs by their leaves).
inline torch::Tensor leaf_copy(const torch::Tensor& t, bool grad) {
  if (!t.defined()) return t;
  auto copy = t.detach().clone();
  if (grad && copy.is_floating_point()) copy.requires_grad_(true);
  return copy;
}

inline Batch leaf_input(const Batch& b, bool grad) {
  if (b.atomic()) return Batch(leaf_copy(b.tensor(), grad));
  std::vector<torch::Tensor> out;
  for (const auto& t : b.tensors()) out.push_back(leaf_copy(t, grad));
  return Batch(std::move(out));
}

// Skips while profiling stage by stage: a pop of a skip this run stashed gets the tensor itself
// (the stage's backward flows through it, as in a pipe); one an earlier stage stashed gets a
// fresh leaf of it, as a skip message delivers it. What the stage stashes stays here.
class StageSkips final : public SkipTrackerBase {
 public:
  explicit StageSkips(std::map<const SkipInfo*, torch::Tensor> earlier)
      : earlier_(std::move(earlier)) {}
  void stash(const SkipInfo& skip, torch::Tensor tensor) override { here_[&skip] = tensor; }
  torch::Tensor pop(const SkipInfo& skip) override {
    if (auto it = here_.find(&skip); it != here_.end()) {
      auto t = it->second;
      here_.erase(it);
      return t;
    }
    auto it = earlier_.find(&skip);
    TORCH_CHECK(it != earlier_.end(), "stagewise::profile_stages: a layer pops skip ",
                skip.describe(),
                " that no earlier layer stashed; the layer that stashes it must come first");
    auto leaf = leaf_copy(it->second, /*grad=*/true);
    earlier_.erase(it);
    popped.push_back(leaf);
    return leaf;
  }
  // What the next stages may pop: the earlier stages' skips left, and this stage's (detached).
  std::map<const SkipInfo*, torch::Tensor> left() const {
    auto out = earlier_;
    for (const auto& [skip, t] : here_) out[skip] = t.defined() ? t.detach() : t;
    return out;
  }
  std::vector<torch::Tensor> popped;  // the leaves this run popped from earlier stages

 private:
  std::map<const SkipInfo*, torch::Tensor> earlier_;
  std::map<const SkipInfo*, torch::Tensor> here_;
};

// One run of a stage: its output, its inputs that want a gradient (its input and the skips it
// popped), and what later stages may pop.
struct StageRun {
  Batch out{torch::Tensor()};
  std::vector<torch::Tensor> inputs;
  std::map<const SkipInfo*, torch::Tensor> skips;
};

inline StageRun run_stage(StageSpec& stage, const Batch& in,
                          const std::map<const SkipInfo*, torch::Tensor>& skips) {
  StageSkips tracker(skips);
  StageRun r;
  {
    UseSkipTracker use(tracker);
    r.out = stage.fn(in);
  }
  for (const auto& t : in) {
    if (t.defined() && t.requires_grad()) r.inputs.push_back(t);
  }
  for (const auto& t : tracker.popped) {
    if (t.defined() && t.requires_grad()) r.inputs.push_back(t);
  }
  r.skips = tracker.left();
  return r;
}

// Where a stage's backward starts. A stage before the last: its outputs, with gradients the
// next stage made (made before the cell is measured). The last with a loss: the loss, computed
// here as the pipe's last stage does (the cell keeps it and its outputs); without, its outputs
// with gradients of ones.
inline std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> backward_roots(
    const Batch& out, const StageLoss* loss) {
  std::vector<torch::Tensor> roots, grads;
  if (loss != nullptr && loss->fn) {
    TORCH_CHECK(out.atomic(), "stagewise::profile_stages: the last stage returns ", out.size(),
                " tensors; the loss takes one, as train_step's does");
    auto l = loss->fn(out.tensor(), loss->target);
    roots.push_back(l);
    grads.push_back(torch::ones_like(l));
    return {std::move(roots), std::move(grads)};
  }
  for (const auto& t : out) {
    if (t.defined() && t.requires_grad()) {
      roots.push_back(t);
      grads.push_back(torch::ones_like(t));
    }
  }
  return {std::move(roots), std::move(grads)};
}

inline double bytes_of(const Batch& b) {
  double n = 0;
  for (const auto& t : b) n += t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
  return n;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Measures stage `stage` on input `in` (a fresh leaf batch) with the earlier stages' skips.
// `best` keeps each time's fastest round; round 0 warms up (and leaves the parameters'
// gradients in place, as in a pipe after its first step) and is not timed; the bytes are read in
// round 1.
inline void measure_stage(StageSpec& stage, const Batch& in,
                          const std::map<const SkipInfo*, torch::Tensor>& skips, int round,
                          torch::Device device, DeviceBytes& bytes, const StageLoss* loss,
                          StageCosts& c) {
  auto timed = [&](double& slot, double took) {
    if (round > 0) slot = std::min(slot, took);
  };
  const bool measure = round == 1;
  {
    // F, then B.
    synchronize(device);
    const std::int64_t before = bytes.current();
    auto t0 = std::chrono::steady_clock::now();
    StageRun r = run_stage(stage, in, skips);
    auto [roots, grads] = backward_roots(r.out, loss);
    synchronize(device);
    timed(c.forward, seconds_since(t0));
    synchronize(device);
    const std::int64_t kept = bytes.current();
    if (measure) {
      c.whole.forward = static_cast<double>(kept - before);
      c.output_bytes = bytes_of(r.out);
    }
    bytes.reset_peak();
    t0 = std::chrono::steady_clock::now();
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    synchronize(device);
    timed(c.backward, seconds_since(t0));
    if (measure) c.whole.working = static_cast<double>(bytes.peak() - kept);
  }
  {
    // F, then I and W.
    const std::int64_t before = bytes.current();
    StageRun r = run_stage(stage, in, skips);
    auto [roots, grads] = backward_roots(r.out, loss);
    synchronize(device);
    const std::int64_t kept = bytes.current();
    bytes.reset_peak();
    runtime::SplitBackward split;
    auto t0 = std::chrono::steady_clock::now();
    auto input_grads = split.input_grad(roots, grads, r.inputs);
    synchronize(device);
    timed(c.input_grad, seconds_since(t0));
    if (measure) c.split.working = static_cast<double>(bytes.peak() - kept);
    // What the cell holds between I and W: the output, the input gradients (sent on) and its
    // own graph's references are gone; W's branches remain.
    input_grads.clear();
    roots.clear();
    r = StageRun{};
    synchronize(device);
    const std::int64_t held = bytes.current();
    if (measure) {
      c.split.forward = static_cast<double>(kept - before);
      c.split.input_grad = static_cast<double>(held - before);
    }
    bytes.reset_peak();
    t0 = std::chrono::steady_clock::now();
    split.weight_grad();
    synchronize(device);
    timed(c.weight_grad, seconds_since(t0));
    if (measure) c.split.weight_working = static_cast<double>(bytes.peak() - held);
  }
}

}  // namespace detail

/// What one micro-batch (`sample`) costs each stage of `model` split by `b`: each stage is run
/// alone, on copies of its layers, fed what the stages before it output (and the skips they
/// stashed), forward then a whole backward, and forward then a split one (I, W), one untimed
/// round and `options.rounds()` timed ones (each time its fastest round). Bytes are counted on
/// the profiling device (the CPU: a counting allocator; CUDA: the caching allocator's statistics,
/// built with -DSTAGEWISE_WITH_CUDA), with the parameters' gradients already there, as in a pipe
/// after its first step: what `schedule::peak_bytes` and `schedule::worker_memory` take. The
/// model is left as it was; a parameter with a gradient is an error. With `loss`, the last stage
/// computes it on `loss.target` (one micro-batch's) and back-propagates from it, as a pipe's
/// last stage does; the loss's own bytes then count too.
///   auto costs = stagewise::profile_stages(model, sw::balance{3, 3}, torch::randn({16, 64}));
///   costs[1].split.input_grad;  // what stage 1's cell holds between its I and its W
inline std::vector<StageCosts> profile_stages(const torch::nn::Sequential& model, const balance& b,
                                              const Batch& sample,
                                              const BalanceOptions& options = {},
                                              const StageLoss& loss = {}) {
  const char* who = "stagewise::profile_stages";
  const torch::Device device = detail::profiling_device(model, sample, options, who);
  detail::verify_sequential(model, b);
  detail::Sandbox sandbox(model, device, who);
  auto stages = detail::partition(sandbox.seq(), b);
  detail::DeviceBytes bytes(device, who);
  StageLoss on_device = loss;
  if (loss.fn && loss.target.defined()) on_device.target = runtime::copy_to(loss.target, device);
  std::vector<StageCosts> out(stages.size());
  Batch batch = detail::sample_on(sample, device);
  std::map<const SkipInfo*, torch::Tensor> skips;
  const double inf = std::numeric_limits<double>::infinity();
  for (std::size_t j = 0; j < stages.size(); ++j) {
    StageCosts& c = out[j];
    c.forward = c.backward = c.input_grad = c.weight_grad = inf;
    for (const auto& p : stages[j].module->parameters()) {
      const double n = static_cast<double>(p.nbytes());
      c.param_bytes += n;
      c.largest_param_bytes = std::max(c.largest_param_bytes, n);
      c.tensor_bytes.push_back(n);
    }
    const Batch in = detail::leaf_input(batch, j > 0 || detail::requires_grad(sample));
    for (int round = 0; round <= std::max(options.rounds(), 1); ++round) {
      const bool last = j + 1 == stages.size();
      detail::measure_stage(stages[j], in, skips, round, device, bytes, last ? &on_device : nullptr, c);
    }
    // The next stage's input and skips, from one more forward without a graph.
    detail::StageRun r;
    {
      torch::NoGradGuard no_grad;
      r = detail::run_stage(stages[j], in, skips);
    }
    c.input_bytes = detail::bytes_of(in);
    for (const auto& [skip, t] : skips) {
      if (!r.skips.count(skip) && t.defined()) c.input_bytes += static_cast<double>(t.nbytes());
    }
    c.whole.kept = c.split.kept = c.input_bytes;
    c.whole.input_grad = c.whole.forward;
    batch = r.out;
    skips = std::move(r.skips);
  }
  return out;
}

}  // namespace stagewise
