#pragma once

#include <torch/types.h>

namespace stagewise::optim {

/// An optimizer whose parameters are spread over several processes, each stepping its own share
/// (`distributed::Sharded`, optimizer state sharded over data-parallel replicas): a GradScaler
/// sums its inf/NaN checks over every process through `sum_found_inf` before it steps, so that an
/// inf in any share skips the step on every process and the scales stay the same.
class JobWideChecks {
 public:
  virtual ~JobWideChecks() = default;
  /// Every process's `found` (a one-element float tensor: this process's count of infs and NaNs)
  /// summed, the same on every process; every process calls it at the same point.
  virtual torch::Tensor sum_found_inf(const torch::Tensor& found) = 0;
};

}  // namespace stagewise::optim
