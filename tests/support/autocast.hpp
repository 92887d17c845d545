#pragma once

// CPU and CUDA autocast switches for tests, on every LibTorch version: the CPU-specific calls
// (`at::autocast::set_cpu_enabled`) are deprecated from 2.4 in favour of the device-type forms.
//   stagewise::testing::set_cpu_autocast(true);  ...  stagewise::testing::set_cpu_autocast(false);

#include "stagewise/core/version.hpp"

#include <ATen/autocast_mode.h>

namespace stagewise::testing {

/// Whether CPU autocast is on for this thread.
inline bool cpu_autocast_enabled() {
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_cpu_enabled();
#else
  return at::autocast::is_autocast_enabled(at::kCPU);
#endif
}

/// Turns CPU autocast on or off for this thread.
inline void set_cpu_autocast(bool enabled) {
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_cpu_enabled(enabled);
#else
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
#endif
}

/// Turns CUDA autocast on or off for this thread.
inline void set_cuda_autocast(bool enabled) {
#if !STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_enabled(enabled);
#else
  at::autocast::set_autocast_enabled(at::kCUDA, enabled);
#endif
}

}  // namespace stagewise::testing

namespace stagewise::testing {

/// CPU autocast (bf16) on for its lifetime; at its end autocast is off and this thread's cast
/// cache cleared, as leaving an autocast region does.
///   { stagewise::testing::CpuAutocastRegion region; y = model->forward(x); }
struct CpuAutocastRegion {
  CpuAutocastRegion() { set_cpu_autocast(true); }
  ~CpuAutocastRegion() {
    set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
  CpuAutocastRegion(const CpuAutocastRegion&) = delete;
  CpuAutocastRegion& operator=(const CpuAutocastRegion&) = delete;
};

}  // namespace stagewise::testing
