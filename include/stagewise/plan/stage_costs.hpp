#pragma once

#include "stagewise/core/batch.hpp"
#include "stagewise/core/rng.hpp"
#include "stagewise/plan/detail/device_bytes.hpp"
#include "stagewise/runtime/split_backward.hpp"
#include "stagewise/schedule/simulate.hpp"
#include "stagewise/skip/tracker.hpp"
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
#include <optional>
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
  /// Kept from F to B (the cell's own: its input and the gradient it receives apart; its output
  /// and, on the last stage, the loss included), F's and B's working memory (above the cell and
  /// the received gradient), and the gradient it sends back (`sent_grad`, its inputs').
  schedule::CellBytes whole;
  /// The same for a split backward: kept from F to I, from I to W (the cell's own; whether W
  /// keeps its inputs and the received gradient too is in `weight_reads_input` and
  /// `weight_reads_grad`), and F's, I's and W's working memory.
  schedule::CellBytes split;
  /// A cell's inputs (the stage's input and the skips it pops): what a checkpointed cell keeps.
  double input_bytes = 0;
  /// The stage's output (the next stage's input).
  double output_bytes = 0;
  /// The skips the stage stashes (a later stage pops them).
  double stash_bytes = 0;
  /// What a checkpointed cell keeps besides its inputs: the random-number generators' state its
  /// recompute replays (on the profiling device: the CPU generator's on the CPU, none on CUDA).
  double replay_bytes = 0;
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

// Where a stage's backward starts: the loss, computed here as the pipe's last stage does (the
// cell keeps it and its outputs), or, before the last stage or without a loss, its outputs.
inline std::vector<torch::Tensor> backward_roots(const Batch& out, const StageLoss* loss) {
  if (loss != nullptr && loss->fn) {
    TORCH_CHECK(out.atomic(), "stagewise::profile_stages: the last stage returns ", out.size(),
                " tensors; the loss takes one, as train_step's does");
    return {loss->fn(out.tensor(), loss->target)};
  }
  std::vector<torch::Tensor> roots;
  for (const auto& t : out) {
    if (t.defined() && t.requires_grad()) roots.push_back(t);
  }
  return roots;
}

// The gradients a backward starts from: ones, standing for what the next stage sends (or the
// loss's own gradient).
inline std::vector<torch::Tensor> ones_for(const std::vector<torch::Tensor>& roots) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : roots) grads.push_back(torch::ones_like(t));
  return grads;
}

inline double bytes_of(const Batch& b) {
  double n = 0;
  for (const auto& t : b) n += t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
  return n;
}

inline double bytes_of(const std::vector<torch::Tensor>& ts) {
  double n = 0;
  for (const auto& t : ts) n += t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
  return n;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What a checkpointed cell's replay keeps on `device`: the generators' state.
inline double replay_bytes(torch::Device device, DeviceBytes& bytes) {
  synchronize(device);
  const std::int64_t before = bytes.current();
  const auto state = RngState::capture(device);
  synchronize(device);
  return static_cast<double>(bytes.current() - before);
}

// One cell's forward measured: its output and roots, what it keeps (bytes since `before`, the
// cell's input not included) and the most it held above that while it ran (F's temporaries).
struct MeasuredForward {
  StageRun run;
  std::vector<torch::Tensor> roots;
  std::int64_t before = 0;
  std::int64_t kept = 0;
  double working = 0;
  double seconds = 0;
};

inline MeasuredForward measure_forward(StageSpec& stage, const Batch& in,
                                       const std::map<const SkipInfo*, torch::Tensor>& skips,
                                       torch::Device device, DeviceBytes& bytes,
                                       const StageLoss* loss) {
  MeasuredForward f;
  synchronize(device);
  f.before = bytes.current();
  bytes.reset_peak();
  const auto t0 = std::chrono::steady_clock::now();
  f.run = run_stage(stage, in, skips);
  f.roots = backward_roots(f.run.out, loss);
  synchronize(device);
  f.seconds = seconds_since(t0);
  f.kept = bytes.current();
  f.working = static_cast<double>(bytes.peak() - f.kept);
  return f;
}

// A fresh leaf copy of the input for each measured cell, as a pipe's cell takes (its gradient is
// then made anew, as the one a cell sends back).
inline Batch fresh_input(const Batch& in) {
  bool grad = false;
  for (const auto& t : in) grad = grad || (t.defined() && t.requires_grad());
  return leaf_input(in, grad);
}

// F, then a whole backward B: B's time, the cell's bytes, F's and B's working memory (above the
// cell and the gradient it received), and the gradient it sends back (its inputs').
inline void measure_whole(StageSpec& stage, const Batch& in,
                          const std::map<const SkipInfo*, torch::Tensor>& skips, bool measure,
                          torch::Device device, DeviceBytes& bytes, const StageLoss* loss,
                          StageCosts& c, double& forward_seconds, double& backward_seconds) {
  Batch x = fresh_input(in);
  MeasuredForward f = measure_forward(stage, x, skips, device, bytes, loss);
  forward_seconds = f.seconds;
  auto grads = ones_for(f.roots);
  synchronize(device);
  const std::int64_t received = bytes.current() - f.kept;
  bytes.reset_peak();
  const auto t0 = std::chrono::steady_clock::now();
  if (!f.roots.empty()) torch::autograd::backward(f.roots, grads);
  synchronize(device);
  backward_seconds = seconds_since(t0);
  if (!measure) return;
  c.whole.forward = static_cast<double>(f.kept - f.before);
  c.whole.forward_working = f.working;
  c.whole.working = static_cast<double>(bytes.peak() - f.kept - received);
  for (const auto& t : f.run.inputs)
    c.whole.sent_grad += t.grad().defined() ? static_cast<double>(t.grad().nbytes()) : 0.0;
  c.output_bytes = bytes_of(f.run.out);
}

// F, then I and W: their times, the cell's bytes between I and W (its own: the gradient it
// received and its inputs apart, which W may keep too), I's and W's working memory.
inline void measure_split(StageSpec& stage, const Batch& in,
                          const std::map<const SkipInfo*, torch::Tensor>& skips, bool measure,
                          torch::Device device, DeviceBytes& bytes, const StageLoss* loss,
                          StageCosts& c, double& input_seconds, double& weight_seconds) {
  std::optional<Batch> x(fresh_input(in));
  const double input = bytes_of(*x);
  MeasuredForward f = measure_forward(stage, *x, skips, device, bytes, loss);
  auto grads = ones_for(f.roots);
  synchronize(device);
  const double received = static_cast<double>(bytes.current() - f.kept);
  bytes.reset_peak();
  runtime::SplitBackward split;
  auto t0 = std::chrono::steady_clock::now();
  auto input_grads = split.input_grad(f.roots, grads, f.run.inputs);
  synchronize(device);
  input_seconds = seconds_since(t0);
  const double working = static_cast<double>(bytes.peak() - f.kept) - received;
  // What the cell holds between I and W: the gradients it sent, its outputs and its own graph's
  // references are gone; then the gradient it received and its inputs, unless W keeps them.
  const double sent = bytes_of(input_grads);
  input_grads.clear();
  f.roots.clear();
  f.run = StageRun{};
  synchronize(device);
  const double with_both = static_cast<double>(bytes.current());
  grads.clear();
  synchronize(device);
  const double with_input = static_cast<double>(bytes.current());
  x.reset();
  synchronize(device);
  const std::int64_t held = bytes.current();
  const double grad_kept = received - (with_both - with_input);
  const double input_kept = input - (with_input - static_cast<double>(held));
  if (measure) {
    c.split.forward = static_cast<double>(f.kept - f.before);
    c.split.forward_working = f.working;
    c.split.input_working = working;
    c.split.working = working;
    c.split.sent_grad = sent;
    c.split.weight_reads_grad = grad_kept > 0;
    c.split.weight_reads_input = input_kept > 0;
    // f.before counted the input
    c.split.input_grad = static_cast<double>(held - f.before) + input - grad_kept - input_kept;
  }
  bytes.reset_peak();
  t0 = std::chrono::steady_clock::now();
  split.weight_grad();
  synchronize(device);
  weight_seconds = seconds_since(t0);
  if (measure) c.split.weight_working = static_cast<double>(bytes.peak() - held);
}

// Measures stage `stage` on input `in` (a leaf batch; each cell takes a fresh copy of it) with
// the earlier stages' skips. Each time keeps its fastest round; round 0 warms up (and leaves
// the parameters' gradients in place, as in a pipe after its first step) and is not timed; the
// bytes are read in round 1.
inline void measure_stage(StageSpec& stage, const Batch& in,
                          const std::map<const SkipInfo*, torch::Tensor>& skips, int round,
                          torch::Device device, DeviceBytes& bytes, const StageLoss* loss,
                          StageCosts& c) {
  auto timed = [&](double& slot, double took) {
    if (round > 0) slot = std::min(slot, took);
  };
  const bool measure = round == 1;
  double f = 0, b = 0, i = 0, w = 0;
  measure_whole(stage, in, skips, measure, device, bytes, loss, c, f, b);
  measure_split(stage, in, skips, measure, device, bytes, loss, c, i, w);
  timed(c.forward, f);
  timed(c.backward, b);
  timed(c.input_grad, i);
  timed(c.weight_grad, w);
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
  const double replay = detail::replay_bytes(device, bytes);
  for (std::size_t j = 0; j < stages.size(); ++j) {
    StageCosts& c = out[j];
    c.forward = c.backward = c.input_grad = c.weight_grad = inf;
    c.replay_bytes = replay;
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
    for (const auto& [skip, t] : r.skips) {
      if (!skips.count(skip) && t.defined()) c.stash_bytes += static_cast<double>(t.nbytes());
    }
    c.whole.kept = c.split.kept = c.input_bytes;
    c.whole.input_grad = c.whole.forward;
    batch = r.out;
    skips = std::move(r.skips);
  }
  return out;
}

}  // namespace stagewise
