#pragma once

// The state of one GradientReducer (runtime/c10d/gradient_reducer.hpp): its parameters and their
// buckets, the hooks on their gradient accumulators, and what one reduction goes through: which
// gradients are ready, which buckets are launched, and the averages written back once every
// all-reduce has completed, with the checks that keep the ranks together. Sharded, the averages
// reach only their owners, and the owners' updated parameters are sent back (shard_reduction.hpp).

#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/detail/reducer_bucket.hpp"
#include "stagewise/runtime/c10d/detail/reducer_writes.hpp"
#include "stagewise/runtime/c10d/detail/shard_reduction.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

struct ReducerState;

// On parameter `index`'s gradient accumulator, before it adds a gradient (sharded only).
struct ReducerPreHook final : torch::autograd::FunctionPreHook {
  ReducerPreHook(ReducerState* s, std::size_t i) : state(s), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override;
  ReducerState* state;
  std::size_t index;
};

// On parameter `index`'s gradient accumulator: tells the state its gradient arrived.
struct ReducerHook final : torch::autograd::FunctionPostHook {
  ReducerHook(ReducerState* s, std::size_t i) : state(s), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;
  ReducerState* state;
  std::size_t index;
};

struct ReducerState {
  Collectives group;
  ReducerOptions options;
  std::vector<ReducerParam> params;
  std::vector<ReducerBucket> buckets;
  std::mutex mutex;
  bool enabled = true;
  bool active = false;            // a marked backward is running
  std::vector<char> ready;        // per parameter, this backward
  std::vector<char> accumulated;  // per parameter, a gradient since the last reduction
  std::vector<std::string> late;  // parameters that got a gradient after their reduction
  std::size_t next_launch = 0;
  std::int64_t bytes = 0;
  std::function<void(std::size_t)> after_reduce;
  torch::Tensor used;  // per parameter, 1 where this rank gave it a gradient; then summed
  c10::intrusive_ptr<c10d::Work> count_work;
  bool launched_by_hand = false;  // launch() ran, complete() not yet
  // Sharded only:
  std::vector<std::string> taken;  // got a gradient here that another hook freed before launch
  ParameterGather gather;          // the owners' updated parameters on their way
  // Sharded: an optimizer that sends the owners' updates after its step is attached
  // (distributed::Sharded); without it (or a fused step's after_reduce) no update would reach
  // the other ranks.
  bool sender_attached = false;
  std::function<bool()> gather_after_reduce;  // true: each bucket's owned parameters are sent
                                              // once after_reduce stepped them
  bool wait_gathers = false;  // the reduction waits for what it sent before returning
  // Reduced per pass (ReducerOptions::reduce_each_pass): whether a step's passes have begun, and
  // per parameter whether any pass of the step gave it a gradient here.
  bool in_step = false;
  std::vector<char> used_any;
  // Sharded: per owned parameter, the gradient the last reduction wrote (held weakly: a gradient
  // reset to none lets it go), and, while the next reduction runs, that average set aside
  // (before_gradient) to add the new one to.
  std::vector<InstalledGrad> installed;
  std::vector<torch::Tensor> carried;
  AwaitWork pass_wait;  // how this pass waits for its earlier buckets (bounding those in flight)

  bool sharded() const { return options.shard; }
  int me() const { return group.rank(); }

  void plan_buckets() {
    buckets = plan_reducer_buckets(params, options.bucket_bytes, sharded() ? group.size() : 0);
    ready.assign(params.size(), 0);
    accumulated.assign(params.size(), 0);
    installed.assign(params.size(), std::nullopt);
    carried.assign(params.size(), torch::Tensor());
  }

  // Sharded, before a gradient is added to parameter i's (its gradient accumulator's pre-hook): if
  // the gradient there is still the average the last reduction wrote (not stepped and freed, nor
  // reset to none; zeroed in place, as LibTorch 1.13's zero_grad() does, it is zeros), it is set
  // aside, so that this rank contributes only what it accumulates from here, and the next
  // reduction adds the new average to it: reducing twice without a step accumulates as unsharded.
  void before_gradient(std::size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sharded() || params[i].owner != me()) return;
    auto& p = params[i];
    auto& grad = p.tensor.mutable_grad();
    if (installed_is(i, grad)) {
      carried[i] = grad;
      grad.reset();
    }
    installed[i].reset();
  }
  // Whether `grad` is the very tensor the last reduction wrote as parameter i's average.
  bool installed_is(std::size_t i, const torch::Tensor& grad) const {
    return is_installed(installed[i], grad);
  }

  void hook_all() {
    for (std::size_t i = 0; i < params.size(); ++i) hook(i);
  }
  void hook(std::size_t i) {
    auto& p = params[i];
    auto node = torch::autograd::impl::grad_accumulator(p.tensor);
    TORCH_CHECK(node, options.who, ": ", p.name, " no longer requires grad");
    if (node == p.accumulator) return;
    unhook(p);
    // Driven by launch() (a pipe's stage, reduced once a step), only the pre-hook: backward there
    // is not this reducer's to follow.
    if (options.from_backward || options.reduce_each_pass) {
      p.hook_key = node->add_post_hook(std::make_unique<ReducerHook>(this, i));
    }
    if (sharded()) {
      auto pre = std::make_unique<ReducerPreHook>(this, i);
      p.pre_hook = pre.get();
      node->add_pre_hook(std::move(pre));
    }
    p.accumulator = std::move(node);
  }
  // Removes parameter p's hooks from its gradient accumulator.
  static void unhook(ReducerParam& p) {
    if (!p.accumulator) return;
    if (p.hook_key != 0) p.accumulator->del_post_hook(p.hook_key);
    p.hook_key = 0;
    auto& pre = p.accumulator->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [&](const auto& h) { return h.get() == p.pre_hook; }),
              pre.end());
    p.pre_hook = nullptr;
    p.accumulator.reset();
  }
  void unhook_all() {
    std::lock_guard<std::mutex> lock(mutex);
    auto quietly = [](const c10::intrusive_ptr<c10d::Work>& w, const std::string&) {
      try {
        w->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    };
    for (auto& b : buckets) {
      if (b.work) quietly(b.work, "");
      for (const auto& w : b.shard.works) quietly(w, "");
    }
    gather.wait(quietly);
    for (auto& p : params) unhook(p);
  }

  // At the start of a marked backward (its first node), on the thread running it.
  void begin_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!enabled || active) return;
    active = true;
    // A parameter given other storage in place (torch::load) has a new AccumulateGrad node.
    for (std::size_t i = 0; i < params.size(); ++i) hook(i);
    start_round();
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_backward(); });
  }

  // A new reduction: nothing ready, nothing launched (and, unless it is a further pass of a step
  // reduced per pass, no owner's sum yet).
  void start_round() {
    if (!options.reduce_each_pass) {
      for (auto& b : buckets) b.shard.mine = torch::Tensor();
    }
    ready.assign(params.size(), 0);
    if (!options.reduce_each_pass) late.clear();  // per pass: a step's, cleared at its first
    taken.clear();
    next_launch = 0;
    bytes = 0;
    count_work.reset();
    for (auto& b : buckets) {
      b.pending = b.members.size();
      b.launched = false;
      b.work.reset();
    }
  }

  void on_gradient(std::size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!active) {  // a backward under no_sync: accumulate only
      TORCH_CHECK(!enabled, options.who, ": ", params[i].name,
                  " got a gradient in a backward that did not start from a marked output, "
                  "so it would not be averaged over the ranks and they would drift apart. "
                  "Compute the loss from DataParallel::forward's outputs (not the module's own "
                  "forward), or run local-only passes under no_sync()");
      accumulated[i] = 1;
      return;
    }
    auto& b = buckets[params[i].bucket];
    if (ready[i]) {
      if (b.launched) late.push_back(params[i].name);
      return;
    }
    ready[i] = 1;
    if (--b.pending == 0) launch_ready();
  }

  // Launches the buckets whose gradients are final, in bucket order on every rank (c10d
  // matches collectives by their order).
  void launch_ready() {
    if (sharded()) {  // free what has arrived: a rank holds little more than its own part
      for (std::size_t k = 0; k < next_launch; ++k) {
        auto& s = buckets[k].shard;
        if (!s.retired && s.done()) s.retire(me(), group.size(), options.reduce_scatter);
      }
    }
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      // Sharded, inside a backward: at most kInFlight of its buckets travel at once, so that a
      // rank ahead of the others does not hold a whole backward's copies; the wait is for
      // buckets every rank launches in the same order (DataParallel's, or a pipe's pass).
      if (sharded() && active && next_launch >= kInFlight) {
        const auto k = next_launch - kInFlight;
        auto& s = buckets[k].shard;
        for (const auto& w : s.works) {
          const auto what = "bucket " + std::to_string(k) + " of the gradients";
          if (pass_wait) {
            pass_wait(w, what);
          } else {
            w->wait();
          }
        }
        s.retire(me(), group.size(), options.reduce_scatter);
      }
      launch(buckets[next_launch++]);
    }
  }
  static constexpr std::size_t kInFlight = 2;

  void launch(ReducerBucket& b) {
    const auto& first = params[b.members.front()].tensor;
    torch::NoGradGuard no_grad;
    if (sharded() && b.members.size() == 1) {
      // One gradient: it travels itself (reduced in place), no copy.
      const auto k = b.members.front();
      auto& grad = params[k].tensor.mutable_grad();
      if ((ready[k] || accumulated[k]) && grad.defined() && grad.is_contiguous()) {
        auto flat = grad.detach().reshape({-1});
        grad.reset();
        bytes += b.numel * static_cast<std::int64_t>(flat.element_size());
        b.launched = true;
        b.shard.launch(group, options.reduce_scatter, std::move(flat));
        return;
      }
    }
    // Sharded, the copy lives only while it travels; else it is kept for the next step.
    torch::Tensor flat = sharded() ? torch::Tensor() : b.flat;
    if (!flat.defined()) flat = torch::empty({b.numel}, first.options());
    for (const auto k : b.members) {
      auto& p = params[k];
      auto slice = flat.narrow(0, p.offset, p.tensor.numel());
      auto& grad = p.tensor.mutable_grad();
      const bool mine = ready[k] || accumulated[k];
      if (mine && grad.defined()) {
        slice.copy_(grad.reshape({-1}));
        if (sharded()) grad.reset();  // the copy travels; only the owner gets the average
      } else {
        if (mine && sharded()) taken.push_back(p.name);
        slice.zero_();  // no gradient here: zeros, as one process on the whole batch
      }
    }
    bytes += b.numel * static_cast<std::int64_t>(flat.element_size());
    b.launched = true;
    if (sharded()) {
      b.shard.launch(group, options.reduce_scatter, std::move(flat));
      return;
    }
    b.flat = flat;
    std::vector<at::Tensor> tensors{b.flat};
    b.work = group.all_reduce_sum(tensors);
  }

  // Reduced per pass: before a backward pass of a step (a micro-batch's B or W), on its thread.
  // The previous pass's reductions are waited for first (through `wait`), so a rank holds no
  // more than one pass's buckets in flight.
  void begin_pass(const AwaitWork& wait) {
    std::lock_guard<std::mutex> lock(mutex);
    pass_wait = wait;
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      auto& s = buckets[k].shard;
      for (const auto& w : s.works) wait(w, "bucket " + std::to_string(k) + " of the gradients");
      s.retire(me(), group.size(), options.reduce_scatter);
    }
    if (!in_step) {
      in_step = true;
      used_any.assign(params.size(), 0);
      late.clear();
      for (auto& b : buckets) b.shard.mine = torch::Tensor();
    }
    start_round();
    active = true;
  }
  // Reduced per pass: after the pass, what is left goes (parameters it did not reach as zeros).
  void end_pass() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& b : buckets) b.pending = 0;
    launch_ready();
    active = false;
    for (std::size_t i = 0; i < params.size(); ++i) used_any[i] |= ready[i];
  }

  // When the marked backward ends (the engine's final callback), on its thread.
  void end_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    active = false;
    for (auto& b : buckets) b.pending = 0;  // what is left goes now, unused parameters as zeros
    launch_ready();
    launch_counts();
    complete_locked({});
  }

  // Starts counting how many ranks gave each parameter a gradient.
  void launch_counts() {
    auto mine = torch::empty({static_cast<std::int64_t>(params.size())}, torch::kFloat);
    auto* u = mine.data_ptr<float>();
    for (std::size_t i = 0; i < params.size(); ++i) {
      u[i] = (ready[i] || accumulated[i]) ? 1.0F : 0.0F;
    }
    // On the parameters' device: NCCL reduces only GPU tensors (Gloo takes either).
    used = params.empty() ? mine : mine.to(params.front().tensor.device());
    std::vector<at::Tensor> counts{used};
    count_work = group.all_reduce_sum(counts);
  }

  // Waits for the launched all-reduces, checks them and writes the averages (sharded: into the
  // owners' gradients only, freeing the others'), calling after_reduce bucket by bucket.
  void complete_locked(const AwaitWork& wait) {
    std::ostringstream taken_names;  // got a gradient here, but another hook freed it
    int n_taken = 0;
    for (const auto& name : taken) taken_names << (n_taken++ ? ", " : "") << name;
    for (std::size_t i = 0; i < params.size() && !sharded(); ++i) {
      const bool mine = ready[i] || accumulated[i];
      if (mine && !params[i].tensor.grad().defined()) {
        taken_names << (n_taken++ ? ", " : "") << params[i].name;
      }
    }
    accumulated.assign(params.size(), 0);
    auto await = [&](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
      if (wait) {
        wait(w, what);
      } else {
        w->wait();
      }
    };
    await(count_work, "the count of the ranks that gave each parameter a gradient");
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const auto what = "bucket " + std::to_string(k) + " of the gradients";
      if (!sharded()) await(buckets[k].work, what);
      for (const auto& w : buckets[k].shard.works) await(w, what);
    }
    const auto used_here = used.to(torch::kCPU);
    const auto* u = used_here.data_ptr<float>();
    TORCH_CHECK(n_taken == 0, options.who, ": ", taken_names.str(),
                " got a gradient in this backward, but another hook freed it before it was "
                "averaged over the ranks (an optim::FusedStep attached to these parameters steps "
                "on this rank's gradient alone, and the ranks drift apart); give the fused step "
                "to DataParallel::step_with(fused), which steps on the averages");
    check_counts(params, late, group.size(), options, u);
    torch::NoGradGuard no_grad;
    for (auto& b : buckets) {
      if (sharded()) {
        write_owned(b, params, u, group.size(), options.reduce_scatter, me(), carried, installed);
      } else {
        write_all(b, params, u, group.size());
      }
      if (!after_reduce) continue;
      for (const auto i : b.members) {
        if (u[i] > 0 && (!sharded() || params[i].owner == me())) after_reduce(i);
      }
      if (sharded() && gather_after_reduce && gather_after_reduce()) {
        gather_bucket(gather, group, b, params);
      }
    }
    if (wait_gathers) gather.wait(await);
    TORCH_CHECK(!sharded() || after_reduce || sender_attached, options.who,
                ": the gradients were reduced to their owners (the optimizer state is sharded), "
                "but no optimizer will send the owners' updates to the other ranks, which would "
                "go on with the old values: step with distributed::Sharded<Optimizer> (built "
                "before the first backward; its step() sends them) or a fused step, not a plain "
                "LibTorch optimizer");
  }
};

inline torch::autograd::variable_list ReducerPreHook::operator()(
    const torch::autograd::variable_list& grads) {
  state->before_gradient(index);
  return grads;
}

inline torch::autograd::variable_list ReducerHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
  state->on_gradient(index);
  return outputs;
}

}  // namespace stagewise::runtime::detail
