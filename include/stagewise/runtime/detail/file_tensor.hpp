#pragma once

// Where a tensor lies in one of FileStore's files (its stage files of activations and its
// optimizer-state files): whether it was defined, its shape and type, and its bytes at an offset.

#include <c10/core/ScalarType.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace stagewise::runtime::detail {

struct FileTensor {
  bool defined = false;
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::int64_t offset = 0;
  std::int64_t bytes = 0;

  /// A CPU tensor of its shape and type to read its bytes into.
  torch::Tensor empty_host() const {
    return torch::empty(sizes, torch::TensorOptions().dtype(dtype));
  }
};

}  // namespace stagewise::runtime::detail
