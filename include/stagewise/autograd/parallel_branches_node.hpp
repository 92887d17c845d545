#pragma once

// Internals of stagewise::parallel_branches: the autograd node that joins the branches' graphs to
// the caller's and runs their backwards on a pool, and the forward runner that builds them.

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

namespace detail {

using torch::autograd::variable_list;

// A branch: its input tensors in, its output tensors out (public name: stagewise::Branch).
using BranchFn = std::function<variable_list(const variable_list&)>;

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
                node->name(),
                ", recorded before the branch ran or on another thread). Pass that "
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

// True if a branch's inputs hold no element at all (each defined one has a zero dimension, e.g. no
// rows) and there is at least one.
inline bool all_empty(const variable_list& inputs) {
  bool any = false;
  for (const auto& input : inputs) {
    if (!input.defined()) continue;
    if (input.numel() != 0) return false;
    any = true;
  }
  return any;
}

// Runs every branch's forward on the pool. With `state`, each branch starts from leaf copies of
// its inputs (recorded in `state->leaves`) so that the branches' graphs are disjoint.
inline std::vector<variable_list> run_forwards(const std::vector<BranchFn>& branches,
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
    if (all_empty(inputs[i])) {
      // Nothing to compute (an expert that got no tokens): run it for its output shapes only,
      // recording no graph, so its parameters get no gradient, as when a loop skips it.
      torch::NoGradGuard no_grad;
      outputs[i] = branches[i](leaves);
    } else {
      outputs[i] = branches[i](leaves);
    }
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
    auto state =
        c10::static_intrusive_pointer_cast<BranchesState>(ctx->saved_data["state"].toCapsule());
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

}  // namespace stagewise
