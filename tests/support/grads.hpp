#pragma once

// Test helpers for comparing gradients and parameters: a snapshot of tensors' .grad, a reset, and
// the first parameter that differs between two modules.

#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <string>
#include <vector>

namespace stagewise::testing {

/// Copies of the tensors' gradients (undefined where a tensor has none).
inline std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : tensors) grads.push_back(t.grad().defined() ? t.grad().clone() : t.grad());
  return grads;
}

/// Drops the tensors' gradients.
inline void zero_grads(const std::vector<torch::Tensor>& tensors) {
  for (const auto& t : tensors) t.mutable_grad().reset();
}

/// What differs between `mine` and `theirs` (named parameters or buffers, e.g. a distributed
/// pipe's and the reference pipe's): the first of `mine` missing from `theirs` or not equal to it
/// bit for bit, named; empty if every one is there and equal.
///   const auto diff = first_difference(pipe->named_parameters(), ref->named_parameters());
///   TORCH_CHECK(diff.empty(), diff);
inline std::string first_difference(const torch::OrderedDict<std::string, torch::Tensor>& mine,
                                    const torch::OrderedDict<std::string, torch::Tensor>& theirs) {
  for (const auto& p : mine) {
    const auto* other = theirs.find(p.key());
    if (other == nullptr) return "no " + p.key() + " in the reference";
    if (!p.value().equal(*other)) return p.key() + " differs";
  }
  return "";
}

}  // namespace stagewise::testing
