#pragma once

// Test helper: convolutions that compute the same gradients on every LibTorch a test runs on.

#include <ATen/Context.h>

namespace stagewise::testing {

/// Turns oneDNN (MKL-DNN) off for this process, so convolutions use ATen's own kernels.
///
/// Debian 13's LibTorch 2.6 (libtorch2.6 2.6.0+dfsg-7, running on libdnnl 3.7.2) returns wrong
/// input gradients from oneDNN's convolution backward: with no pipeline and no threads of ours, a
/// Conv2d(2, 4, 3) input gradient differs from ATen's by up to 3.5 (of values about 1), and by a
/// different amount in each process. docs/ci.md has the measurement. Tests that compare a pipelined
/// convolutional model with the unpipelined one call this first, so that what they compare is
/// stagewise and not that package.
inline void use_plain_convolutions() { at::globalContext().setUserEnabledMkldnn(false); }

}  // namespace stagewise::testing
