#pragma once

// A counting CPU allocator for benchmarks: wraps LibTorch's CPU allocator and tracks the bytes of
// tensor memory alive now and at peak. Install it once, before the tensors to be measured exist.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>

namespace stagewise::bench {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(std::size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* ctx = new Context{std::move(inner), n, this};
    add(static_cast<long long>(n));
    return c10::DataPtr(data, ctx, &CountingAllocator::release, device);
  }

  // Pure virtual in LibTorch 2.x, absent in 1.13: no `override`, so both compile.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  long long current() const { return current_.load(); }
  long long peak() const { return peak_.load(); }
  /// Starts a new peak measurement from what is alive now.
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    std::size_t bytes;
    const CountingAllocator* owner;
  };

  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    ctx->owner->add(-static_cast<long long>(ctx->bytes));
    delete ctx;  // frees the wrapped allocation
  }

  void add(long long delta) const {
    const long long now = current_.fetch_add(delta) + delta;
    long long seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* base_;
  mutable std::atomic<long long> current_{0};
  mutable std::atomic<long long> peak_{0};
};

/// Installs (once) and returns the process-wide counting allocator.
inline CountingAllocator& counting_allocator() {
  static CountingAllocator* instance = [] {
    auto* a = new CountingAllocator(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/100);
    return a;
  }();
  return *instance;
}

}  // namespace stagewise::bench
