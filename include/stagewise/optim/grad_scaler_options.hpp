#pragma once

// amp::GradScalerOptions: what amp::GradScaler (optim/grad_scaler.hpp) takes, as PyTorch's
// torch.amp.GradScaler constructor does.

#include <torch/arg.h>

#include <cstdint>

namespace stagewise::amp {

/// The options of `GradScaler`, with PyTorch's defaults.
///   sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(1024).growth_interval(100));
struct GradScalerOptions {
  /// The scale before the first update (2^16).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// What the scale is multiplied by after `growth_interval` steps in a row without inf/NaN (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// What the scale is multiplied by after a step with an inf or a NaN gradient (< 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// The number of steps in a row without inf/NaN before the scale grows.
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  /// False: every call is a no-op, as PyTorch's disabled scaler (`step` just steps).
  TORCH_ARG(bool, enabled) = true;
};

}  // namespace stagewise::amp
