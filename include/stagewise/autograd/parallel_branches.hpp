#pragma once

#include "stagewise/core/phony.hpp"
#include "stagewise/runtime/thread_pool.hpp"
#include "stagewise/runtime/thread_state.hpp"

#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

namespace stagewise {

/// One branch for `parallel_branches`: takes its input tensors, returns its output tensors.
using Branch = std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;

/// A one-tensor-in, one-tensor-out branch for the single-tensor form of `parallel_branches`.
using TensorBranch = std::function<torch::Tensor(const torch::Tensor&)>;

namespace detail {

using torch::autograd::variable_list;

// Everything the backward needs, shared by the forward call and the autograd node (which holds it
// in its context as a capsule, so it dies with the node if backward never comes).
struct BranchesState : torch::CustomClassHolder {
  std::shared_ptr<ThreadPool> pool;
  std::vector<variable_list> leaves;   // per branch: the detached inputs its graph starts from
  std::vector<variable_list> outputs;  // per branch: its outputs, which hold its graph
  // Position of each defined input / output in the node's flat lists; -1 for undefined ones.
  std::vector<std::vector<std::int64_t>> input_slot;
  std::vector<std::vector<std::int64_t>> output_slot;
  bool released = false;

  void release() {
    leaves.clear();
    outputs.clear();
    released = true;
  }
};

// Fails if the graph a branch recorded reaches a node that the branch did not record: the branch
// used a tensor from the surrounding graph that it did not get as an input, and its backward (on a
// pool thread) would run into the surrounding graph, concurrently with the caller's backward.
// A node belongs to the branch if it was recorded on this thread (`thread`) at or after the
// branch started (sequence numbers count up per thread). Leaves' accumulators, marked with
// sequence number UINT64_MAX, end the walk.
inline void check_self_contained(const variable_list& outputs, std::uint64_t thread,
                                 std::uint64_t first, std::size_t branch) {
  std::vector<torch::autograd::Node*> pending;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) pending.push_back(out.grad_fn().get());
  }
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (!seen.insert(node).second || node->sequence_nr() == UINT64_MAX) continue;
    TORCH_CHECK(node->thread_id() == thread && node->sequence_nr() >= first,
                "stagewise::parallel_branches: branch ", branch,
                " differentiates through a tensor computed outside the branch (its graph reaches ",
                node->name(), ", recorded before the branch ran or on another thread). Pass that "
                "tensor to the branch as one of its inputs, or detach() it if it needs no "
                "gradient.");
    for (const auto& edge : node->next_edges()) {
      if (edge.function) pending.push_back(edge.function.get());
    }
  }
}

// Switches LibTorch's autocast cast cache off on this thread for a branch: a cached cast made
// outside the branch would join the branch's graph to the caller's.
class NoAutocastCache {
 public:
  NoAutocastCache() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(previous_); }

 private:
  bool previous_;
};

// Runs every branch's forward on the pool. With `state`, each branch starts from leaf copies of
// its inputs (recorded in `state->leaves`) so that the branches' graphs are disjoint.
inline std::vector<variable_list> run_forwards(const std::vector<Branch>& branches,
                                               const std::vector<variable_list>& inputs,
                                               ThreadPool& pool, BranchesState* state) {
  const ThreadState caller;
  std::vector<variable_list> outputs(branches.size());
  if (state) state->leaves.assign(branches.size(), {});
  pool.run(branches.size(), [&](std::size_t i) {
    ThreadStateGuard guard(caller);
    if (!state) {
      outputs[i] = branches[i](inputs[i]);
      return;
    }
    variable_list leaves;
    leaves.reserve(inputs[i].size());
    for (const auto& input : inputs[i]) {
      if (!input.defined()) {
        leaves.emplace_back();
        continue;
      }
      auto leaf = input.detach();
      if (input.requires_grad()) leaf.requires_grad_(true);
      leaves.push_back(std::move(leaf));
    }
    NoAutocastCache no_cache;
    const auto thread = at::RecordFunction::currentThreadId();
    const auto first = at::sequence_number::peek();
    outputs[i] = branches[i](leaves);
    check_self_contained(outputs[i], thread, first, i);
    state->leaves[i] = std::move(leaves);
  });
  return outputs;
}

// Runs one branch's backward for the gradients that reached the node; fills `input_grads` (flat).
inline void run_backward(BranchesState& state, std::size_t i, const variable_list& grads,
                         const std::vector<char>& needed, bool keep_graph, bool accumulate,
                         variable_list& input_grads) {
  variable_list roots;
  variable_list root_grads;
  for (std::size_t j = 0; j < state.outputs[i].size(); ++j) {
    const auto slot = state.output_slot[i][j];
    if (slot < 0 || !grads[slot].defined() || !state.outputs[i][j].requires_grad()) continue;
    roots.push_back(state.outputs[i][j]);
    root_grads.push_back(grads[slot]);
  }
  if (roots.empty()) return;
  auto& leaves = state.leaves[i];
  if (accumulate) {
    // A plain backward: parameters inside the branch accumulate their .grad like the leaves do.
    torch::autograd::backward(roots, root_grads, keep_graph, /*create_graph=*/false);
    for (std::size_t k = 0; k < leaves.size(); ++k) {
      const auto slot = state.input_slot[i][k];
      if (slot < 0 || !leaves[k].requires_grad()) continue;
      input_grads[slot] = leaves[k].grad();
      leaves[k].mutable_grad().reset();  // a retained graph may see another backward
    }
    return;
  }
  // torch::autograd::grad or backward(inputs=...): only the needed inputs, nothing accumulated.
  variable_list wanted;
  std::vector<std::int64_t> wanted_slots;
  for (std::size_t k = 0; k < leaves.size(); ++k) {
    const auto slot = state.input_slot[i][k];
    if (slot < 0 || !needed[slot] || !leaves[k].requires_grad()) continue;
    wanted.push_back(leaves[k]);
    wanted_slots.push_back(slot);
  }
  if (wanted.empty()) return;
  auto got = torch::autograd::grad(roots, wanted, root_grads, keep_graph, /*create_graph=*/false,
                                   /*allow_unused=*/true);
  for (std::size_t k = 0; k < got.size(); ++k) input_grads[wanted_slots[k]] = got[k];
}

// The node that joins the branches' graphs to the surrounding graph. Its forward only hands out
// the outputs the branches already computed; its backward runs the branches' backwards on the pool.
struct ParallelBranchesFunction : torch::autograd::Function<ParallelBranchesFunction> {
  static variable_list forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<BranchesState> state,
                               at::TensorList /*flat_inputs*/, const torch::Tensor& /*phony*/) {
    ctx->set_materialize_grads(false);
    variable_list flat;
    variable_list constant;
    for (std::size_t i = 0; i < state->outputs.size(); ++i) {
      for (std::size_t j = 0; j < state->outputs[i].size(); ++j) {
        if (state->output_slot[i][j] < 0) continue;
        const auto& out = state->outputs[i][j];
        flat.push_back(out.detach());
        if (!out.requires_grad()) constant.push_back(flat.back());
      }
    }
    ctx->mark_non_differentiable(constant);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return flat;
  }

  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "stagewise::parallel_branches: double backward (create_graph=true) is not "
                "supported. Call backward without create_graph, or run the branches one after "
                "another (a plain loop) where you need higher-order gradients.");
    auto state = c10::static_intrusive_pointer_cast<BranchesState>(
        ctx->saved_data["state"].toCapsule());
    TORCH_CHECK(!state->released,
                "stagewise::parallel_branches: backward through the branches a second time, but "
                "their graphs were freed by the first backward. Pass retain_graph=true to the "
                "first backward (as for any graph) if you need to backward twice.");
    std::size_t flat_inputs = 0;
    for (const auto& slots : state->input_slot) {
      for (auto slot : slots) flat_inputs += slot >= 0 ? 1 : 0;
    }
    std::vector<char> needed(flat_inputs);
    for (std::size_t k = 0; k < flat_inputs; ++k) needed[k] = ctx->needs_input_grad(k);
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    const bool accumulate = exec_info == nullptr || exec_info->empty();

    variable_list input_grads(flat_inputs);
    const ThreadState caller;
    try {
      state->pool->run(state->outputs.size(), [&](std::size_t i) {
        ThreadStateGuard guard(caller);
        run_backward(*state, i, grads, needed, keep_graph, accumulate, input_grads);
      });
    } catch (...) {
      if (!keep_graph) state->release();
      throw;
    }
    if (!keep_graph) state->release();

    variable_list result;
    result.reserve(flat_inputs + 2);
    result.emplace_back();  // the state argument
    for (auto& grad : input_grads) result.push_back(std::move(grad));
    result.emplace_back();  // the phony
    return result;
  }
};

}  // namespace detail

/// Runs `branches[i](inputs[i])` for every i concurrently on a thread pool and returns the outputs
/// as ordinary autograd-connected tensors; when backward reaches them, each branch's backward runs
/// concurrently too, and the input gradients flow on into the surrounding graph.
///
/// Use it for independent sub-networks, e.g. the experts of a mixture-of-experts layer or the
/// towers of a multi-branch block. Results equal running the branches one after another. A branch
/// gets leaf copies of its inputs, so every tensor it differentiates through must come in through
/// `inputs` or be a leaf such as a parameter (otherwise: an error naming the fix). Parameters used
/// by the branches accumulate their `.grad` on the pool threads. The caller's thread-local state
/// (grad mode, autocast, intra-op thread count) reaches the workers; under no-grad the branches
/// just run in parallel and nothing is recorded. An exception from any branch, in forward or
/// backward, reaches the caller unchanged once the other branches finished or were skipped.
///   auto outs = stagewise::parallel_branches(
///       {[&](const variable_list& in) { return variable_list{expert0(in[0])}; },
///        [&](const variable_list& in) { return variable_list{expert1(in[0])}; }},
///       {{x0}, {x1}});  // outs[1][0] is expert1(x1)
inline std::vector<torch::autograd::variable_list> parallel_branches(
    const std::vector<Branch>& branches, const std::vector<torch::autograd::variable_list>& inputs,
    std::shared_ptr<ThreadPool> pool = default_thread_pool()) {
  TORCH_CHECK(branches.size() == inputs.size(), "stagewise::parallel_branches: got ",
              branches.size(), " branches but ", inputs.size(),
              " input sets. Pass one input set per branch; repeat a tensor for branches that "
              "share it, e.g. {{x}, {x}}.");
  for (std::size_t i = 0; i < branches.size(); ++i) {
    TORCH_CHECK(branches[i], "stagewise::parallel_branches: branch ", i,
                " is empty (a default-constructed std::function). Give every branch a callable.");
  }
  TORCH_CHECK(pool, "stagewise::parallel_branches: the pool is null. Pass a ThreadPool, e.g. "
                    "std::make_shared<stagewise::ThreadPool>(4), or leave the argument out.");
  if (!torch::GradMode::is_enabled()) return detail::run_forwards(branches, inputs, *pool, nullptr);

  auto state = c10::make_intrusive<detail::BranchesState>();
  state->pool = pool;
  auto outputs = detail::run_forwards(branches, inputs, *pool, state.get());

  torch::autograd::variable_list flat_inputs;
  state->input_slot.resize(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    for (const auto& input : inputs[i]) {
      state->input_slot[i].push_back(input.defined() ? std::int64_t(flat_inputs.size()) : -1);
      if (input.defined()) flat_inputs.push_back(input);
    }
  }
  std::int64_t flat_outputs = 0;
  bool any_requires_grad = false;
  state->output_slot.resize(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const auto& out : outputs[i]) {
      state->output_slot[i].push_back(out.defined() ? flat_outputs++ : -1);
      any_requires_grad = any_requires_grad || (out.defined() && out.requires_grad());
    }
  }
  // Nothing to differentiate (no input or parameter requires grad): no node, no graphs kept.
  if (!any_requires_grad) return outputs;

  state->outputs = outputs;
  // The phony requires grad, so the node is recorded even when only parameters inside the
  // branches do (the inputs may not require grad at all).
  // The flat inputs go in as a TensorList: LibTorch's Function::apply records edges for Tensor
  // and TensorList arguments, not for a std::vector of tensors.
  auto flat = detail::ParallelBranchesFunction::apply(state, at::TensorList(flat_inputs),
                                                      phony(torch::kCPU, true));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (std::size_t j = 0; j < outputs[i].size(); ++j) {
      const auto slot = state->output_slot[i][j];
      if (slot >= 0) outputs[i][j] = flat[slot];
    }
  }
  return outputs;
}

/// The single-tensor form: `out[i] = branches[i](inputs[i])`, run as `parallel_branches` does.
///   auto ys = stagewise::parallel_branches({tower_a, tower_b}, {x, x});  // both towers share x
inline std::vector<torch::Tensor> parallel_branches(
    const std::vector<TensorBranch>& branches, const std::vector<torch::Tensor>& inputs,
    std::shared_ptr<ThreadPool> pool = default_thread_pool()) {
  std::vector<Branch> wrapped;
  wrapped.reserve(branches.size());
  for (const auto& branch : branches) {
    TORCH_CHECK(branch, "stagewise::parallel_branches: branch ", wrapped.size(),
                " is empty (a default-constructed std::function). Give every branch a callable.");
    wrapped.emplace_back([&branch](const torch::autograd::variable_list& in) {
      return torch::autograd::variable_list{branch(in[0])};
    });
  }
  std::vector<torch::autograd::variable_list> sets;
  sets.reserve(inputs.size());
  for (const auto& input : inputs) sets.push_back({input});
  auto outputs = parallel_branches(wrapped, sets, std::move(pool));
  std::vector<torch::Tensor> result;
  result.reserve(outputs.size());
  for (auto& out : outputs) result.push_back(std::move(out[0]));
  return result;
}

}  // namespace stagewise
