#pragma once

// A counting CPU allocator for benchmarks: wraps LibTorch's CPU allocator and tracks the bytes of
// tensor memory alive now and at peak. Install it once, before the tensors to be measured exist.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <unordered_map>

// `c10::Allocator::allocate` is `const` in LibTorch 1.x and not in 2.x (it was dropped in 2.3; CI
// checks 1.13 and 2.6): the override follows the installed version.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define STAGEWISE_BENCH_ALLOCATE_CONST
#else
#define STAGEWISE_BENCH_ALLOCATE_CONST const
#endif

namespace stagewise::bench {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  // The data pointer is its own context (LibTorch's raw_allocate insists on that); the wrapped
  // allocation and its size wait in a table until the deleter runs.
  c10::DataPtr allocate(std::size_t n) STAGEWISE_BENCH_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Entry{std::move(inner), n});
    }
    add(static_cast<long long>(n));
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  // Pure virtual in LibTorch 2.x, absent in 1.13: no `override`, so both compile.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  long long current() const { return current_.load(); }
  long long peak() const { return peak_.load(); }
  /// Starts a new peak measurement from what is alive now.
  void reset_peak() { peak_.store(current_.load()); }

  static CountingAllocator*& instance() {
    static CountingAllocator* self = nullptr;
    return self;
  }

 private:
  struct Entry {
    c10::DataPtr inner;
    std::size_t bytes;
  };

  static void release(void* data) {
    CountingAllocator* self = instance();
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->live_.find(data);
      if (it == self->live_.end()) {
        // Allocated by the wrapped allocator before this one was installed (some kernels keep
        // the allocator they first saw), but freed through the current raw deleter.
        self->base_->raw_deleter()(data);
        return;
      }
      entry = std::move(it->second);
      self->live_.erase(it);
    }
    self->add(-static_cast<long long>(entry.bytes));
    // entry.inner frees the wrapped allocation here, outside the lock
  }

  void add(long long delta) const {
    const long long now = current_.fetch_add(delta) + delta;
    long long seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Entry> live_;
  mutable std::atomic<long long> current_{0};
  mutable std::atomic<long long> peak_{0};
};

/// Installs (once) and returns the process-wide counting allocator.
inline CountingAllocator& counting_allocator() {
  static CountingAllocator* instance = [] {
    auto* a = new CountingAllocator(c10::GetDefaultCPUAllocator());
    CountingAllocator::instance() = a;
    c10::SetCPUAllocator(a, /*priority=*/100);
    return a;
  }();
  return *instance;
}

}  // namespace stagewise::bench
