#pragma once

#include "stagewise/autograd/detail/parallel_branches_node.hpp"
#include "stagewise/core/phony.hpp"
#include "stagewise/threads/thread_pool.hpp"

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace stagewise {

/// One branch for `parallel_branches`: takes its input tensors, returns its output tensors.
using Branch = detail::BranchFn;

/// A one-tensor-in, one-tensor-out branch for the single-tensor form of `parallel_branches`.
using TensorBranch = std::function<torch::Tensor(const torch::Tensor&)>;

/// Runs `branches[i](inputs[i])` for every i concurrently on a thread pool and returns the outputs
/// as ordinary autograd-connected tensors; when backward reaches them, each branch's backward runs
/// concurrently too, and the input gradients flow on into the surrounding graph.
///
/// On CUDA, each branch runs on a stream of its own from the device's pool (after the caller's
/// current stream, which made its inputs; the caller's stream then waits for it, so the outputs
/// are ready there). Autograd runs a GPU's backward work on one thread per GPU, so the backwards
/// of branches on a GPU run on that thread one after another, re-entrantly, while their kernels
/// may overlap on the branches' streams; the gradients come back ready on the stream autograd
/// expects. CPU-only branches of the same call still run their backwards on the pool. Results
/// equal the sequential branches on CUDA too; on one GPU no case measured ran faster than a loop
/// (docs/parallel_backward.md, "On CUDA").
///
/// Use it for independent sub-networks, e.g. the experts of a mixture-of-experts layer or the
/// towers of a multi-branch block. Results equal running the branches one after another. A branch
/// gets leaf copies of its inputs, so every tensor it differentiates through must come in through
/// `inputs` or be a leaf such as a parameter (otherwise: an error naming the fix). Parameters used
/// by the branches accumulate their `.grad` where their backward runs. The caller's thread-local
/// state (grad mode, autocast, intra-op thread count) reaches the workers; under no-grad the
/// branches just run in parallel and nothing is recorded. An exception from any branch, in forward
/// or backward, reaches the caller unchanged once the other branches finished or were skipped.
/// A branch whose inputs are all empty (e.g. an expert that got no tokens: zero rows) runs under
/// no-grad for its output shapes only: it records no graph and costs nothing in backward, and its
/// parameters get no gradient (they are left undefined, so optimizers skip them), as when a
/// sequential loop skips an expert without tokens.
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
  TORCH_CHECK(pool,
              "stagewise::parallel_branches: the pool is null. Pass a ThreadPool, e.g. "
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
