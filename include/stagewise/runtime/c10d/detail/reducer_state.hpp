#pragma once

// The state of one GradientReducer (runtime/c10d/gradient_reducer.hpp): its parameters and their
// buckets, the hooks on their gradient accumulators, and what one reduction goes through: which
// gradients are ready, which buckets are launched, and the averages written back once every
// all-reduce has completed, with the checks that keep the ranks together.

#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/reducer_options.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

struct ReducerParam {
  torch::Tensor tensor;
  std::string name;
  std::shared_ptr<torch::autograd::Node> accumulator;
  std::uintptr_t hook_key = 0;
  std::size_t bucket = 0;
  std::int64_t offset = 0;
};

struct ReducerBucket {
  std::vector<std::size_t> members;
  std::int64_t numel = 0;
  std::size_t pending = 0;
  bool launched = false;
  torch::Tensor flat;
  c10::intrusive_ptr<c10d::Work> work;
};

struct ReducerState;

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

  void plan_buckets() {
    std::map<std::pair<int, std::string>, std::size_t> open;  // (dtype, device) -> bucket
    for (std::size_t k = params.size(); k-- > 0;) {
      const auto& t = params[k].tensor;
      const auto key = std::make_pair(static_cast<int>(t.scalar_type()), t.device().str());
      auto it = open.find(key);
      const auto bytes = static_cast<std::int64_t>(t.numel() * t.element_size());
      if (it != open.end()) {
        const auto& b = buckets[it->second];
        const auto element = static_cast<std::int64_t>(t.element_size());
        if ((b.numel * element) + bytes > options.bucket_bytes) open.erase(it);
      }
      it = open.find(key);
      if (it == open.end()) {
        buckets.emplace_back();
        it = open.emplace(key, buckets.size() - 1).first;
      }
      auto& b = buckets[it->second];
      params[k].bucket = it->second;
      params[k].offset = b.numel;
      b.members.push_back(k);
      b.numel += t.numel();
    }
    ready.assign(params.size(), 0);
    accumulated.assign(params.size(), 0);
  }

  void hook_all() {
    for (std::size_t i = 0; i < params.size(); ++i) hook(i);
  }
  void hook(std::size_t i) {
    auto& p = params[i];
    auto node = torch::autograd::impl::grad_accumulator(p.tensor);
    TORCH_CHECK(node, options.who, ": ", p.name, " no longer requires grad");
    if (node == p.accumulator) return;
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    p.hook_key = node->add_post_hook(std::make_unique<ReducerHook>(this, i));
    p.accumulator = std::move(node);
  }
  void unhook_all() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& b : buckets) {
      if (b.work) {
        try {
          b.work->wait();
        } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
        }
      }
    }
    for (auto& p : params) {
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
      p.accumulator.reset();
    }
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

  // A new reduction: nothing ready, nothing launched.
  void start_round() {
    ready.assign(params.size(), 0);
    late.clear();
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
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      launch(buckets[next_launch++]);
    }
  }

  void launch(ReducerBucket& b) {
    const auto& first = params[b.members.front()].tensor;
    if (!b.flat.defined()) b.flat = torch::empty({b.numel}, first.options());
    torch::NoGradGuard no_grad;
    for (const auto k : b.members) {
      const auto& p = params[k];
      auto slice = b.flat.narrow(0, p.offset, p.tensor.numel());
      const auto& grad = p.tensor.grad();
      if ((ready[k] || accumulated[k]) && grad.defined()) {
        slice.copy_(grad.reshape({-1}));
      } else {
        slice.zero_();  // no gradient here: zeros, as one process on the whole batch
      }
    }
    std::vector<at::Tensor> tensors{b.flat};
    b.work = group.all_reduce_sum(tensors);
    b.launched = true;
    bytes += b.numel * static_cast<std::int64_t>(b.flat.element_size());
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

  // Waits for the launched all-reduces, checks them and writes the averages.
  void complete_locked(const std::function<void(const c10::intrusive_ptr<c10d::Work>&,
                                                const std::string&)>& wait) {
    std::ostringstream taken;  // got a gradient here, but another hook freed it
    int n_taken = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const bool mine = ready[i] || accumulated[i];
      if (mine && !params[i].tensor.grad().defined()) {
        taken << (n_taken++ ? ", " : "") << params[i].name;
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
      await(buckets[k].work, "bucket " + std::to_string(k) + " of the gradients");
    }
    const auto used_here = used.to(torch::kCPU);
    const auto* u = used_here.data_ptr<float>();
    TORCH_CHECK(n_taken == 0, options.who, ": ", taken.str(),
                " got a gradient in this backward, but another hook freed it before it was "
                "averaged over the ranks (an optim::FusedStep attached to these parameters steps "
                "on this rank's gradient alone, and the ranks drift apart); give the fused step "
                "to DataParallel::step_with(fused), which steps on the averages");
    const float world = static_cast<float>(group.size());
    std::ostringstream partly;
    int n_partly = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (u[i] > 0 && u[i] < world) {
        partly << (n_partly++ ? ", " : "") << params[i].name << " (on " << u[i]
               << (u[i] == 1 ? " rank)" : " ranks)");
      }
    }
    TORCH_CHECK(n_partly == 0 || options.unused_parameters, options.who, ": ", n_partly,
                n_partly == 1 ? " parameter" : " parameters",
                " got a gradient on some ranks but not on others in this backward (of ",
                group.size(), " ranks): ", partly.str(), ". Pass ", options.unused_fix,
                " to reduce them with zeros from the others (what one process on the whole batch "
                "computes), or use every "
                "parameter on every rank");
    if (!late.empty()) {
      std::ostringstream names;
      for (std::size_t i = 0; i < late.size(); ++i) names << (i ? ", " : "") << late[i];
      TORCH_CHECK(false, options.who, ": ", names.str(),
                  " got another gradient in this backward after its bucket was reduced (a "
                  "parameter reached twice, e.g. through two reentrant recomputes); its "
                  "gradient would be wrong. Use it once per backward, or reduce it yourself");
    }
    torch::NoGradGuard no_grad;
    for (auto& b : buckets) {
      b.flat.div_(world);
      for (const auto i : b.members) {
        if (u[i] == 0) continue;  // no rank used it: its gradient stays as it is
        auto& p = params[i];
        auto slice = b.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
        auto& grad = p.tensor.mutable_grad();
        if (grad.defined()) {
          grad.copy_(slice);
        } else {
          grad = slice.clone();
        }
      }
      if (!after_reduce) continue;
      for (const auto i : b.members) {
        if (u[i] > 0) after_reduce(i);
      }
    }
  }
};

inline torch::autograd::variable_list ReducerHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
  state->on_gradient(index);
  return outputs;
}

}  // namespace stagewise::runtime::detail
