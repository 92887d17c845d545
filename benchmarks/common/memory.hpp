#pragma once

// A counting CPU allocator for benchmarks: wraps LibTorch's CPU allocator and tracks the bytes of
// tensor memory alive now and at peak, in all and per allocating thread (a pipeline's worker
// stands for a device: what it allocates is what its device would hold, until freed on whichever
// thread). Install it once, before the tensors to be measured exist.

#include "stagewise/core/version.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace stagewise::bench {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  // The data pointer is its own context (LibTorch's raw_allocate insists on that); the wrapped
  // allocation and its size wait in a table until the deleter runs.
  c10::DataPtr allocate(std::size_t n) STAGEWISE_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    const c10::Device device = inner.device();
    Counter* mine = this_thread();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Entry{std::move(inner), n, mine});
    }
    add(static_cast<long long>(n));
    mine->add(static_cast<long long>(n));
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  // Pure virtual in LibTorch 2.x, absent in 1.13: no `override`, so both compile.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  long long current() const { return current_.load(); }
  long long peak() const { return peak_.load(); }
  /// Starts a new peak measurement from what is alive now, in all and on every thread.
  void reset_peak() {
    peak_.store(current_.load());
    std::lock_guard<std::mutex> lock(threads_mutex_);
    for (auto& t : threads_) t.peak.store(t.current.load());
  }

  /// Bytes alive now that each thread allocated (one entry per thread that ever allocated, in
  /// the order they first did; a thread that exited keeps its entry).
  std::vector<long long> thread_current() const {
    std::lock_guard<std::mutex> lock(threads_mutex_);
    std::vector<long long> out;
    for (const auto& t : threads_) out.push_back(t.current.load());
    return out;
  }
  /// The largest rise over `before` (from `thread_current()`, just before a `reset_peak()`) of
  /// any one thread's bytes since that reset: the peak a single worker, i.e. device, added.
  long long max_thread_rise(const std::vector<long long>& before) const {
    long long most = 0;
    for (long long rise : thread_rises(before)) most = std::max(most, rise);
    return most;
  }
  /// Each thread's rise over `before` since the last reset_peak(), as `max_thread_rise` takes it
  /// (one entry per thread, in the order they first allocated).
  std::vector<long long> thread_rises(const std::vector<long long>& before) const {
    std::lock_guard<std::mutex> lock(threads_mutex_);
    std::vector<long long> out;
    std::size_t i = 0;
    for (const auto& t : threads_) {
      out.push_back(t.peak.load() - (i < before.size() ? before[i] : 0));
      ++i;
    }
    return out;
  }

  static CountingAllocator*& instance() {
    static CountingAllocator* self = nullptr;
    return self;
  }

 private:
  struct Counter {
    std::atomic<long long> current{0};
    std::atomic<long long> peak{0};
    void add(long long delta) {
      const long long now = current.fetch_add(delta) + delta;
      long long seen = peak.load();
      while (now > seen && !peak.compare_exchange_weak(seen, now)) {
      }
    }
  };
  struct Entry {
    c10::DataPtr inner;
    std::size_t bytes;
    Counter* owner = nullptr;
  };

  // This thread's counter, made on its first allocation; counters live as long as the allocator
  // (a deque does not move its elements), so a tensor can outlive the thread that made it.
  Counter* this_thread() const {
    thread_local Counter* mine = nullptr;
    thread_local const CountingAllocator* of = nullptr;
    if (mine == nullptr || of != this) {
      std::lock_guard<std::mutex> lock(threads_mutex_);
      mine = &threads_.emplace_back();
      of = this;
    }
    return mine;
  }

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
    entry.owner->add(-static_cast<long long>(entry.bytes));
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
  mutable std::mutex threads_mutex_;
  mutable std::deque<Counter> threads_;
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
