#pragma once

#include "stagewise/autograd/parallel_branches.hpp"
#include "stagewise/threads/thread_pool.hpp"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stagewise {
namespace detail {

template <std::derived_from<torch::nn::Module> T>
std::shared_ptr<T> impl_ptr(const torch::nn::ModuleHolder<T>& holder) {
  return holder.ptr();
}

template <std::derived_from<torch::nn::Module> T>
std::shared_ptr<T> impl_ptr(const std::shared_ptr<T>& module) {
  return module;
}

}  // namespace detail

/// A module usable as a branch of `ParallelBranches`: a module holder (`torch::nn::Linear`, a
/// `TORCH_MODULE` type, `torch::nn::Sequential`) or a `std::shared_ptr` to a module, whose
/// `forward` takes one tensor and returns one tensor.
///   static_assert(stagewise::branch_module<torch::nn::Linear>);
template <typename M>
concept branch_module = requires(const M& m, const torch::Tensor& x) {
  { detail::impl_ptr(m) } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
  { detail::impl_ptr(m)->forward(x) } -> std::convertible_to<torch::Tensor>;
};

/// Options of `ParallelBranches`: the pool its branches run on and an optional reduction that
/// `forward_reduced` applies to the branches' outputs.
///   stagewise::ParallelBranchesOptions().reduction(
///       [](const std::vector<torch::Tensor>& outs) { return torch::cat(outs, 1); })
struct ParallelBranchesOptions {
  /// Combines the outputs of all branches (in branch order) into one tensor.
  using Reduction = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

  /// The pool that runs the branches' forwards and their CPU backwards; the process-wide one by
  /// default. (Backwards of branches on a GPU run on autograd's thread for that GPU.)
  TORCH_ARG(std::shared_ptr<ThreadPool>, pool) = default_thread_pool();
  /// What `forward_reduced` does with the outputs; unset by default.
  TORCH_ARG(Reduction, reduction);
};

/// A container of branch modules (e.g. the experts of a mixture-of-experts layer) whose forward
/// runs them in parallel with `parallel_branches`, forward and backward alike: on the CPU on the
/// options' pool; on a GPU (after `to(device)`) each branch on a stream of its own, their backwards
/// launched one after another from autograd's thread for that GPU while their kernels overlap.
///
/// The branches are registered as submodules named "0", "1", ... (or the names given), so
/// `parameters()`, optimizers, `train()`/`eval()` and `to()` see them. `forward(x)` gives every
/// branch the same input and returns their outputs in order; `forward_each(xs)` gives branch i
/// `xs[i]`; `forward_reduced(x)` combines the outputs with the options' reduction.
///   stagewise::ParallelBranches experts(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
///   std::vector<torch::Tensor> ys = experts->forward(x);  // ys[i] == expert i (x)
class ParallelBranchesImpl : public torch::nn::Module {
 public:
  /// An empty container; add branches with `push_back`.
  explicit ParallelBranchesImpl(ParallelBranchesOptions options = {})
      : options(std::move(options)) {}

  /// A container of the given branch modules, in order.
  template <branch_module First, branch_module... Rest>
  explicit ParallelBranchesImpl(First first, Rest... rest) {
    push_back(std::move(first));
    (push_back(std::move(rest)), ...);
  }

  /// A container of the given branch modules, with options.
  template <branch_module... Modules>
  ParallelBranchesImpl(ParallelBranchesOptions options, Modules... modules)
      : options(std::move(options)) {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a branch, registered under its index.
  template <branch_module M>
  void push_back(M module) {
    push_back(std::to_string(branches_.size()), std::move(module));
  }

  /// Appends a branch, registered under `name`.
  template <branch_module M>
  void push_back(std::string name, M module) {
    auto impl = detail::impl_ptr(module);
    register_module(std::move(name), std::shared_ptr<torch::nn::Module>(impl));
    branches_.emplace_back(
        [impl](const torch::Tensor& x) -> torch::Tensor { return impl->forward(x); });
  }

  /// The number of branches.
  std::size_t size() const noexcept { return branches_.size(); }

  /// Runs every branch on `input` (a shared input: its gradient sums the branches').
  std::vector<torch::Tensor> forward(const torch::Tensor& input) {
    return parallel_branches(branches_, std::vector<torch::Tensor>(branches_.size(), input),
                             options.pool());
  }

  /// Runs branch i on `inputs[i]`, e.g. the tokens a router sent to expert i. An expert that got
  /// no tokens (zero rows) returns zero rows, records no graph and gets no gradient.
  std::vector<torch::Tensor> forward_each(const std::vector<torch::Tensor>& inputs) {
    TORCH_CHECK(inputs.size() == branches_.size(), "stagewise::ParallelBranches: forward_each got ",
                inputs.size(), " inputs for ", branches_.size(),
                " branches. Pass one input per branch, or call forward(x) to give all the same.");
    return parallel_branches(branches_, inputs, options.pool());
  }

  /// Runs every branch on `input` and combines the outputs with the options' reduction.
  torch::Tensor forward_reduced(const torch::Tensor& input) {
    TORCH_CHECK(static_cast<bool>(options.reduction()),
                "stagewise::ParallelBranches: forward_reduced needs a reduction. Set one with "
                "ParallelBranchesOptions().reduction(...), e.g. [](const std::vector<torch::Tensor>"
                "& outs) { return torch::stack(outs).sum(0); }, or call forward() for the list.");
    return options.reduction()(forward(input));
  }

  /// The options this container was built with.
  ParallelBranchesOptions options;

 private:
  std::vector<TensorBranch> branches_;
};

/// The module holder of `ParallelBranchesImpl` (LibTorch's `TORCH_MODULE` idiom).
TORCH_MODULE(ParallelBranches);

}  // namespace stagewise
