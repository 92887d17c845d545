#pragma once

// The two computations of amp::GradScaler, each through LibTorch's own kernel where this LibTorch
// has one for the tensors' device (CUDA always; the CPU from LibTorch 2.3), and a plain one with
// the same results elsewhere: unscale a gradient and check it for inf/NaN
// (`_amp_foreach_non_finite_check_and_unscale_`), and update the scale
// (`_amp_update_scale_`). Both follow PyTorch's kernels (aten/src/ATen/native/cpu/
// AmpGradScalerKernels.cpp, cuda/AmpKernels.cu): a gradient element v becomes v * inv_scale
// computed in float (in the gradient's own type for double), and any non-finite element sets
// found_inf to 1.

#include "stagewise/core/version.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace stagewise::detail {

// Whether the operator `name` has a kernel registered for `key` in this process.
inline bool has_kernel(const char* name, c10::DispatchKey key) {
  const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  return op.has_value() && op->hasKernelForDispatchKey(key);
}

// Whether LibTorch's GradScaler kernels run on `device` here: on CUDA where the CUDA kernels are
// registered, on the CPU from LibTorch 2.3 (and only where its kernels are registered).
inline bool amp_kernels_on(const c10::Device& device) {
  if (device.is_cuda()) {
    static const bool cuda =
        has_kernel("aten::_amp_foreach_non_finite_check_and_unscale_", c10::DispatchKey::CUDA) &&
        has_kernel("aten::_amp_update_scale_", c10::DispatchKey::CUDA);
    return cuda;
  }
#if STAGEWISE_AMP_CPU_KERNELS
  if (device.is_cpu()) {
    static const bool cpu =
        has_kernel("aten::_amp_foreach_non_finite_check_and_unscale_", c10::DispatchKey::CPU) &&
        has_kernel("aten::_amp_update_scale_", c10::DispatchKey::CPU);
    return cpu;
  }
#endif
  return false;
}

// Whether `v` (float or double) is an inf or a NaN: every exponent bit set. An integer test the
// compiler vectorizes, unlike std::isfinite.
template <class T>
auto non_finite_bit(T v) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  constexpr Bits exponent = static_cast<Bits>(sizeof(T) == 4 ? 0x7f800000ull : 0x7ff0000000000000ull);
  Bits bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<Bits>((bits & exponent) == exponent);
}

// One contiguous float or double span: v = v * inv (in the gradient's type, as PyTorch's kernel
// multiplies), then * coef when clipping (a second rounding, as clip_grad_norm_'s own mul_);
// returns whether any element was not finite before. In blocks of 16 with a fixed inner trip
// count, which g++ -O2 vectorizes (it leaves a loop of unknown length scalar).
template <class T, bool Unit, bool Clip>
bool unscale_span(T* data, std::int64_t n, T inv, T coef) {
  using Bits = decltype(non_finite_bit(T{}));
  Bits bad = 0;
  auto one = [&](T& x, Bits& b) {
    T v = x;
    b |= non_finite_bit(v);
    if constexpr (!Unit) v = v * inv;
    if constexpr (Clip) v = v * coef;
    x = v;
  };
  std::int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    Bits block = 0;
    for (int j = 0; j < 16; ++j) one(data[k + j], block);
    bad |= block;
  }
  for (; k < n; ++k) one(data[k], bad);
  return bad != 0;
}

template <class T>
bool unscale_span(T* data, std::int64_t n, float inv, const float* coef) {
  const T i = static_cast<T>(inv), c = coef != nullptr ? static_cast<T>(*coef) : T(1);
  if (inv == 1.f) {
    return coef != nullptr ? unscale_span<T, true, true>(data, n, i, c)
                           : unscale_span<T, true, false>(data, n, i, c);
  }
  return coef != nullptr ? unscale_span<T, false, true>(data, n, i, c)
                         : unscale_span<T, false, false>(data, n, i, c);
}

// A bf16 or fp16 span, through float as PyTorch's kernel computes it (one rounding back).
template <class T>
bool unscale_reduced(T* data, std::int64_t n, float inv) {
  bool found = false;
  for (std::int64_t k = 0; k < n; ++k) {
    const float v = static_cast<float>(data[k]);
    found = found || !std::isfinite(v);
    data[k] = static_cast<T>(inv == 1.f ? v : v * inv);
  }
  return found;
}

// The plain unscale and check of one gradient, without LibTorch's kernel: one pass over a
// contiguous CPU gradient (its multiplication by `coef`, a float clip coefficient, folded in for
// float gradients and a float coefficient), tensor operations elsewhere. `found_inf` is set to 1 if `grad` holds an inf
// or a NaN; otherwise it is left as it is.
inline void plain_unscale(torch::Tensor& grad, torch::Tensor& found_inf,
                          const torch::Tensor& inv_scale, const torch::Tensor& coef = {}) {
  const float inv = inv_scale.item<float>();
  const auto type = grad.scalar_type();
  const bool fold =
      coef.defined() && type == torch::kFloat && coef.scalar_type() == torch::kFloat;
  const float c = fold ? coef.item<float>() : 1.f;
  if (grad.device().is_cpu() && grad.is_contiguous() && grad.layout() == torch::kStrided) {
    bool found = false;
    const auto n = grad.numel();
    switch (type) {
      case torch::kFloat:
        found = unscale_span(grad.data_ptr<float>(), n, inv, fold ? &c : nullptr);
        break;
      case torch::kDouble:
        found = unscale_span(grad.data_ptr<double>(), n, inv, nullptr);
        break;
      case torch::kBFloat16:
        found = unscale_reduced(grad.data_ptr<c10::BFloat16>(), n, inv);
        break;
      case torch::kHalf:
        found = unscale_reduced(grad.data_ptr<c10::Half>(), n, inv);
        break;
      default:
        TORCH_CHECK(false, "stagewise::amp::GradScaler: a gradient of type ", type,
                    " cannot be unscaled; gradients must be floating point");
    }
    if (found) found_inf.fill_(1.f);
    if (coef.defined() && !fold) grad.mul_(coef);
    return;
  }
  if (!torch::isfinite(grad).all().item<bool>()) found_inf.fill_(1.f);
  if (inv != 1.f) {
    if (type == torch::kDouble) {
      grad.mul_(inv_scale.to(grad.device()));
    } else {
      grad.copy_(grad.to(torch::kFloat).mul_(inv_scale.to(grad.device())));
    }
  }
  if (coef.defined()) grad.mul_(coef);
}

// Unscales `grad` in place by `inv_scale` (a float tensor of one element on the gradient's
// device) and sets `found_inf` (likewise) to 1 if it held an inf or a NaN; then, if `coef` is
// given (a clip coefficient on the gradient's device), multiplies it by that too. LibTorch's
// kernel where it has one, else plain_unscale: the same results.
inline void unscale_and_check(torch::Tensor& grad, torch::Tensor& found_inf,
                              const torch::Tensor& inv_scale, const torch::Tensor& coef = {}) {
  if (amp_kernels_on(grad.device())) {
    std::vector<torch::Tensor> one{grad};
    at::_amp_foreach_non_finite_check_and_unscale_(one, found_inf, inv_scale);
    if (coef.defined()) grad.mul_(coef);
    return;
  }
  plain_unscale(grad, found_inf, inv_scale, coef);
}

// unscale_and_check over several gradients of one device and dtype (GradScaler::unscale_'s
// groups): one call of LibTorch's kernel for all of them where it has one.
inline void unscale_and_check(std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                              const torch::Tensor& inv_scale) {
  if (grads.empty()) return;
  if (amp_kernels_on(grads.front().device())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  for (auto& g : grads) plain_unscale(g, found_inf, inv_scale);
}

// The plain update of the scale (PyTorch's rule): after a step with found_inf, scale *=
// backoff and the growth tracker restarts; after a clean one the tracker counts it, and at
// growth_interval clean steps in a row scale *= growth (kept only if still finite) and the
// tracker restarts. The products are taken in double and rounded to the float scale, as the
// kernels do.
inline void plain_update_scale(torch::Tensor& scale, torch::Tensor& growth_tracker,
                               const torch::Tensor& found_inf, double growth, double backoff,
                               std::int64_t interval) {
  float s = scale.item<float>();
  int tracker = growth_tracker.item<int>();
  if (found_inf.item<float>() != 0.f) {
    s = static_cast<float>(s * backoff);
    tracker = 0;
  } else {
    const int successful = tracker + 1;
    if (successful == interval) {
      const auto grown = static_cast<float>(s * growth);
      if (std::isfinite(grown)) s = grown;
      tracker = 0;
    } else {
      tracker = successful;
    }
  }
  scale.fill_(s);
  growth_tracker.fill_(tracker);
}

// Updates `scale` and `growth_tracker` in place from `found_inf` (all on one device): LibTorch's
// kernel where it has one, else plain_update_scale.
inline void update_scale(torch::Tensor& scale, torch::Tensor& growth_tracker,
                         const torch::Tensor& found_inf, double growth, double backoff,
                         std::int64_t interval) {
  if (amp_kernels_on(scale.device())) {
    at::_amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval);
    return;
  }
  plain_update_scale(scale, growth_tracker, found_inf, growth, backoff, interval);
}

}  // namespace stagewise::detail
