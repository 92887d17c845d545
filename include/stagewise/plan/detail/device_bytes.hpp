#pragma once

// Bytes of tensor memory on a profiling device, now and at peak: on the CPU from the counting
// allocator (installed for the object's lifetime), on CUDA from the caching allocator's
// statistics (built with -DSTAGEWISE_WITH_CUDA). For profile_stages.

#include "stagewise/stage/detail/counting_allocator.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#if defined(STAGEWISE_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdint>
#include <optional>

namespace stagewise::detail {

#if defined(STAGEWISE_WITH_CUDA)
// The caching allocator's statistics of one GPU (entry 0 of each: StatType::AGGREGATE, all
// pools; the statistics' type moved between LibTorch versions).
inline auto cuda_stats(c10::DeviceIndex index) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index);
}
#endif

class DeviceBytes {
 public:
  DeviceBytes(torch::Device device, const char* who) : device_(device) {
#if defined(STAGEWISE_WITH_CUDA)
    if (device.is_cuda()) {
      index_ = device.has_index() ? device.index() : c10::DeviceIndex{0};
      (void)torch::empty({0}, torch::TensorOptions().device(device));  // initializes CUDA
      return;
    }
#endif
    TORCH_CHECK(device.is_cpu(), who, ": measuring memory on ", device.str(),
                " needs the CUDA caching allocator's statistics: build with "
                "-DSTAGEWISE_WITH_CUDA against a CUDA LibTorch, or profile on the CPU "
                "(BalanceOptions().device(torch::kCPU))");
    counting_.emplace();
  }

  std::int64_t current() const {
#if defined(STAGEWISE_WITH_CUDA)
    if (device_.is_cuda()) return cuda_stats(index_).allocated_bytes[0].current;
#endif
    return counting_->current();
  }
  std::int64_t peak() const {
#if defined(STAGEWISE_WITH_CUDA)
    if (device_.is_cuda()) return cuda_stats(index_).allocated_bytes[0].peak;
#endif
    return CountingCpuAllocator::instance().peak();
  }
  void reset_peak() {
#if defined(STAGEWISE_WITH_CUDA)
    if (device_.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(index_);
      return;
    }
#endif
    CountingCpuAllocator::instance().reset_peak();
  }

 private:
#if defined(STAGEWISE_WITH_CUDA)
  c10::DeviceIndex index_ = 0;
#endif
  torch::Device device_;
  std::optional<CountCpuBytes> counting_;
};

}  // namespace stagewise::detail
