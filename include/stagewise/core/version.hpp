#pragma once

// The LibTorch version cut-offs stagewise depends on, in one place.

#include <torch/version.h>

/// Whether the LibTorch being compiled against is at least `major.minor`.
#define STAGEWISE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||            \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

/// LibTorch 2.4 replaced the per-device autocast calls (`is_cpu_enabled`, `set_autocast_cpu_dtype`
/// ...) by device-type forms and deprecated the old ones, and moved the autocast dtypes into
/// `at::ThreadLocalState`.
#define STAGEWISE_AUTOCAST_BY_DEVICE_TYPE STAGEWISE_TORCH_AT_LEAST(2, 4)

/// LibTorch 2.3 gave GradScaler's two kernels (`_amp_foreach_non_finite_check_and_unscale_`,
/// `_amp_update_scale_`) a CPU implementation (before, CUDA only), with `torch.amp.GradScaler("cpu")`.
#define STAGEWISE_AMP_CPU_KERNELS STAGEWISE_TORCH_AT_LEAST(2, 3)

/// The qualifier of a `c10::Allocator::allocate` override: LibTorch 2.3 dropped its `const`.
#if STAGEWISE_TORCH_AT_LEAST(2, 3)
#define STAGEWISE_ALLOCATE_CONST
#else
#define STAGEWISE_ALLOCATE_CONST const
#endif
