#pragma once

#include "stagewise/core/version.hpp"

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace stagewise {

/// The autocast settings of the calling thread for the CPU and CUDA: whether autocast is on for
/// each, the lower-precision dtype of each, and whether casts of parameters are cached.
///
/// Checkpointing captures one beside the random-number state before a checkpointed forward and
/// applies it around the recompute, so the recompute casts exactly as its forward did, wherever
/// backward is called from (also after the autocast region has been left).
///   auto state = stagewise::AutocastState::capture();
///   ...
///   { stagewise::AutocastState::Apply same(state); /* autocast as when captured */ }
class AutocastState {
 public:
  /// The calling thread's settings now.
  static AutocastState capture() {
    AutocastState s;
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    s.cpu_enabled_ = at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
    s.cuda_enabled_ = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    s.cpu_dtype_ = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
    s.cuda_dtype_ = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
#else
    s.cpu_enabled_ = at::autocast::is_cpu_enabled();
    s.cuda_enabled_ = at::autocast::is_enabled();
    s.cpu_dtype_ = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype_ = at::autocast::get_autocast_gpu_dtype();
#endif
    s.cache_enabled_ = at::autocast::is_autocast_cache_enabled();
    return s;
  }

  /// Whether autocast is on for the CPU or for CUDA.
  bool enabled() const noexcept {
    return cpu_enabled_ || cuda_enabled_;
  }
  /// Whether autocast is on for the CPU.
  bool cpu_enabled() const noexcept {
    return cpu_enabled_;
  }
  /// Whether autocast is on for CUDA.
  bool cuda_enabled() const noexcept {
    return cuda_enabled_;
  }
  /// The CPU's lower-precision dtype (bf16 unless changed).
  at::ScalarType cpu_dtype() const noexcept {
    return cpu_dtype_;
  }
  /// CUDA's lower-precision dtype (fp16 unless changed).
  at::ScalarType cuda_dtype() const noexcept {
    return cuda_dtype_;
  }
  /// Whether casts of parameters are cached for the rest of the autocast region.
  bool cache_enabled() const noexcept {
    return cache_enabled_;
  }

  /// Puts a captured state on the calling thread for its lifetime and the thread's own back
  /// afterwards.
  class Apply;

 private:
  void install() const {
#if STAGEWISE_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, cpu_enabled_);
    at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, cuda_enabled_);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype_);
    at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype_);
#else
    at::autocast::set_cpu_enabled(cpu_enabled_);
    at::autocast::set_enabled(cuda_enabled_);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype_);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype_);
#endif
    at::autocast::set_autocast_cache_enabled(cache_enabled_);
  }

  bool cpu_enabled_ = false;
  bool cuda_enabled_ = false;
  at::ScalarType cpu_dtype_ = at::kBFloat16;
  at::ScalarType cuda_dtype_ = at::kHalf;
  bool cache_enabled_ = true;
};

class AutocastState::Apply {
 public:
  explicit Apply(const AutocastState& state) : before_(capture()) { state.install(); }
  ~Apply() { before_.install(); }
  Apply(const Apply&) = delete;
  Apply& operator=(const Apply&) = delete;

 private:
  AutocastState before_;
};

namespace detail {

// Turns autocast's cast cache off for a scope (and back to what it was). A no-grad forward that
// will be recomputed runs under it: otherwise it would cache low-precision copies of parameters
// that have no autograd history, and a later forward with grad in the same region would reuse
// them, so those parameters would get no gradient.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : before_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(before_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool before_;
};

}  // namespace detail

}  // namespace stagewise
