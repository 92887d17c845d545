#pragma once

#include "stagewise/core/dependency.hpp"
#include "stagewise/core/detail/cell.hpp"
#include "stagewise/core/error_context.hpp"
#include "stagewise/core/phony.hpp"

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace stagewise {
namespace detail {

using tensors_fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
// A pipe stage's random-number section (runtime::RngSection) as a checkpoint sees it: `run` runs
// its argument (serializing random-number use across the pipe's workers), `draws_nothing` says
// whether the stage is known to draw none (then its recompute leaves the generators alone). Empty
// for a standalone checkpoint: run directly, always replay.
struct run_section {
  std::function<void(const std::function<void()>&)> run;
  std::function<bool()> draws_nothing;
};

// Shared by one Checkpoint node and its Recompute node.
struct CheckpointCall : torch::CustomClassHolder {
  tensors_fn fn;
  run_section section;
  std::vector<torch::Tensor> inputs;  // kept until the recompute turns them into leaves
  std::optional<CellReplay> replay;   // left by the first run for the recompute
  // The pipeline cell this checkpoint runs (stage and micro-batch), named in the context of the
  // exceptions its recompute and backward raise; none for a standalone checkpoint.
  std::optional<ErrorContext> where;
  bool recomputed = false;
  std::vector<torch::Tensor> outputs;  // of the recompute, with their graph
  std::vector<torch::Tensor> leaves;

  void run(const std::function<void()>& body) const {
    if (section.run) {
      section.run(body);
    } else {
      body();
    }
  }
  bool replay_rng() const { return !section.draws_nothing || !section.draws_nothing(); }
  torch::Device device() const {
    return inputs.empty() ? torch::Device(torch::kCPU) : inputs.front().device();
  }
  // Runs `body`; an exception it raises gains this cell's context for `phase`.
  template <class Body>
  void in_phase(Phase phase, Body&& body) const {
    if (!where) {
      body();
      return;
    }
    try {
      body();
    } catch (...) {
      ErrorContext at = *where;
      at.phase = phase;
      annotate_current_exception(at);
      throw;
    }
  }
};

inline c10::intrusive_ptr<CheckpointCall> call_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CheckpointCall>(ctx->saved_data["call"].toCapsule());
}

// Runs the function without recording a graph; its output becomes this node's output.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                torch::Tensor /*phony*/, at::TensorList /*inputs*/,
                                                c10::intrusive_ptr<CheckpointCall> call) {
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    std::vector<torch::Tensor> out;
    call->run([&] {
      call->replay = run_checkpointed(call->device(), [&] { out = call->fn(call->inputs); });
    });
    std::vector<torch::Tensor> non_differentiable;
    for (auto& t : out) {
      TORCH_CHECK(t.defined(),
                  "stagewise::checkpoint: the checkpointed function returned an "
                  "undefined tensor; return only defined tensors");
      if (!t.is_floating_point() && !t.is_complex()) non_differentiable.push_back(t);
    }
    ctx->mark_non_differentiable(non_differentiable);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto call = call_of(ctx);
    TORCH_CHECK(call->recomputed,
                "stagewise::checkpoint: backward reached a checkpoint whose recompute has not run "
                "(was the output's recompute edge cut by a detach?). Keep the checkpoint's output "
                "connected, or compute without checkpointing.");
    std::vector<torch::Tensor> outs;
    std::vector<torch::Tensor> out_grads;
    for (std::size_t k = 0; k < call->outputs.size(); ++k) {
      if (call->outputs[k].requires_grad()) {
        outs.push_back(call->outputs[k]);
        out_grads.push_back(grads[k]);
      }
    }
    if (!outs.empty()) {
      call->in_phase(Phase::backward, [&] { torch::autograd::backward(outs, out_grads); });
    }
    torch::autograd::variable_list result;
    result.reserve(call->leaves.size() + 2);
    result.emplace_back();  // phony
    for (auto& leaf : call->leaves) result.push_back(leaf.grad());
    result.emplace_back();  // the call object
    call->outputs.clear();
    call->leaves.clear();
    call->recomputed = false;
    return result;
  }
};

// Identity on a phony; its backward re-runs the function with grad enabled, the RNG replayed and
// the autocast settings of the first run (backward may run outside the autocast region, or on
// another thread). It is joined to the checkpoint's output, so it runs before the output's
// gradient goes on.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor phony,
                               c10::intrusive_ptr<CheckpointCall> call) {
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    return phony.detach();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    auto call = call_of(ctx);
    std::vector<torch::Tensor> leaves;
    leaves.reserve(call->inputs.size());
    for (auto& x : call->inputs) leaves.push_back(x.detach().requires_grad_(x.requires_grad()));
    call->in_phase(Phase::recompute, [&] {
      call->run([&] {
        // This thread may be an autograd engine thread, or outside any autocast region: nobody
        // else would clear the recompute's casts before the optimizer step.
        run_recompute(*call->replay, call->replay_rng(), RecomputeCasts::drop,
                      [&] { call->outputs = call->fn(leaves); });
      });
    });
    call->leaves = std::move(leaves);
    call->inputs.clear();
    call->recomputed = true;
    return {torch::Tensor(), torch::Tensor()};
  }
};

// Checkpoints `fn(inputs)`: returns outputs connected to a Checkpoint node, with a Recompute
// node joined to the first output that requires grad. `where` names the pipeline cell in the
// context of exceptions from the recompute and the backward.
inline std::vector<torch::Tensor> checkpoint_tensors(tensors_fn fn,
                                                     std::vector<torch::Tensor> inputs,
                                                     run_section section = {},
                                                     std::optional<ErrorContext> where = {}) {
  auto call = c10::make_intrusive<CheckpointCall>();
  call->fn = std::move(fn);
  call->section = std::move(section);
  call->where = where;
  call->inputs = std::move(inputs);
  const auto device = call->device();
  // A fresh phony, not the cached one: a leaf that requires grad has one AccumulateGrad node,
  // and stage workers wiring that shared node into their graphs at once would race on it.
  auto fresh_phony = torch::empty({0}, torch::TensorOptions().device(device)).requires_grad_();
  auto outputs = CheckpointFunction::apply(fresh_phony, at::TensorList(call->inputs), call);
  for (auto& y : outputs) {
    if (!y.requires_grad()) continue;
    auto [kept, fork_phony] = fork(y);
    y = join(kept, RecomputeFunction::apply(fork_phony, call));
    break;
  }
  return outputs;
}

// Flattening of checkpoint arguments and results: tensors go through autograd, anything else is
// passed through by value.
template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::remove_cvref_t<T>, torch::Tensor>;

template <class T>
void collect_tensors(const T& value, std::vector<torch::Tensor>& out) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    out.push_back(value);
  } else if constexpr (std::is_same_v<U, std::vector<torch::Tensor>>) {
    out.insert(out.end(), value.begin(), value.end());
  }
}

template <class T>
T replace_tensors(const T& value, const std::vector<torch::Tensor>& tensors, std::size_t& next) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    return tensors[next++];
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    std::vector<torch::Tensor> out(tensors.begin() + next, tensors.begin() + next + value.size());
    next += value.size();
    return out;
  } else {
    return value;
  }
}

template <class R>
struct result_traits {
  static_assert(is_tensor_v<R> || std::is_same_v<R, std::vector<torch::Tensor>>,
                "stagewise::checkpoint: the function must return a torch::Tensor, a "
                "std::vector<torch::Tensor> or a std::tuple of them and other values");
  static void flatten(const R& r, std::vector<torch::Tensor>& out) { collect_tensors(r, out); }
  static R rebuild(const R& shape, const std::vector<torch::Tensor>& t, std::size_t& next) {
    return replace_tensors(shape, t, next);
  }
};

template <class... Ts>
struct result_traits<std::tuple<Ts...>> {
  static void flatten(const std::tuple<Ts...>& r, std::vector<torch::Tensor>& out) {
    std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, r);
  }
  static std::tuple<Ts...> rebuild(const std::tuple<Ts...>& shape,
                                   const std::vector<torch::Tensor>& t, std::size_t& next) {
    return std::apply(
        [&](const auto&... e) { return std::tuple<Ts...>{replace_tensors(e, t, next)...}; }, shape);
  }
};

}  // namespace detail

/// Runs `fn(args...)` without keeping its intermediate activations, and recomputes them just
/// before its gradient is needed (LibTorch has no checkpoint API; this is one).
///
/// Tensor arguments (and `std::vector<torch::Tensor>`) are routed through autograd; any other
/// argument is passed through by value. The result may be a Tensor, a vector of Tensors or a
/// tuple mixing them with other values. The CPU generator (and the inputs' device generator) is
/// replayed, so dropout draws the same mask in the recompute, and the recompute runs under the
/// autocast settings of the first run, also when backward is called after leaving the autocast
/// region. The first run caches no autocast casts (they would lack autograd history). Parameters
/// that `fn` captures get gradients even when no input requires grad. Under no-grad it simply
/// calls `fn`.
///   auto y = stagewise::checkpoint([&](const torch::Tensor& x) { return block->forward(x); }, x);
template <class F, class... Args>
requires std::invocable < F&, const std::remove_cvref_t<Args>
&... > auto checkpoint(F&& fn, Args&&... args) {
  using R = std::remove_cvref_t<std::invoke_result_t<F&, const std::remove_cvref_t<Args>&...>>;
  using traits = detail::result_traits<R>;
  if (!torch::GradMode::is_enabled()) return R(fn(args...));

  std::vector<torch::Tensor> inputs;
  (detail::collect_tensors(args, inputs), ...);
  // The closure keeps only the non-tensor arguments: tensors arrive as `tensors` (the inputs or
  // their recompute leaves), so holding them here would keep them alive for nothing.
  const std::vector<torch::Tensor> none(inputs.size());
  std::size_t cleared = 0;
  auto held = std::make_shared<std::tuple<std::remove_cvref_t<Args>...>>(
      detail::replace_tensors(std::remove_cvref_t<Args>(args), none, cleared)...);
  auto shape = std::make_shared<std::optional<R>>();
  auto erased = [f = std::forward<F>(fn), held, shape](const std::vector<torch::Tensor>& tensors) {
    std::size_t next = 0;
    auto call_args = std::apply(
        [&](const auto&... a) {
          return std::tuple<std::remove_cvref_t<Args>...>{
              detail::replace_tensors(a, tensors, next)...};
        },
        *held);
    R result = std::apply([&](const auto&... a) { return R(f(a...)); }, call_args);
    if (!shape->has_value()) *shape = result;  // non-tensor results come from the first run
    std::vector<torch::Tensor> flat;
    traits::flatten(result, flat);
    return flat;
  };
  auto outputs = detail::checkpoint_tensors(std::move(erased), std::move(inputs));
  std::size_t next = 0;
  R result = traits::rebuild(**shape, outputs, next);
  next = 0;
  **shape = traits::rebuild(**shape, std::vector<torch::Tensor>(outputs.size()), next);
  return result;
}

}  // namespace stagewise
