#pragma once

// Test helpers for comparing gradients: a snapshot of tensors' .grad and a reset.

#include <torch/types.h>

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

}  // namespace stagewise::testing
