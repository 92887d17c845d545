#pragma once

#include "stagewise/core/version.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace stagewise {

/// Counts the bytes of CPU tensor memory alive, in all and per thread: an allocation is charged
/// to the thread that made it (a pipeline worker stands for a device: what it allocates is what
/// its device would hold) and its free credited back to that thread, wherever the free happens.
/// Install it once, before the tensors to measure exist; it forwards every allocation to the
/// allocator LibTorch had. `reset_peak()` starts a measurement, `peak()` and `peak_of(thread)`
/// read it. What `plan_pipeline` promises per worker is checked with it
/// (tests/bench/plan_promise_test.cpp, benchmarks/fit.cpp); every benchmark counts with it
/// (benchmarks/common/memory.hpp).
///   auto& meter = stagewise::MemoryMeter::install();   // first thing in main()
///   meter.reset_peak();
///   pipe->train_step(x, y, loss_fn);
///   meter.peak_of(pipe->stage_thread(0));              // bytes stage 0's worker held at its peak
class MemoryMeter final : public c10::Allocator {
 public:
  /// The process's meter, installed in front of LibTorch's CPU allocator on the first call.
  static MemoryMeter& install() {
    static MemoryMeter* meter = [] {
      auto* m = new MemoryMeter(c10::GetCPUAllocator());  // outlives every tensor
      self() = m;
      // The highest priority: a lower one loses to an allocator set before (profiling's
      // counting one sets 255 while it counts, and puts the one before it back).
      c10::SetCPUAllocator(m, /*priority=*/255);
      return m;
    }();
    return *meter;
  }

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
    total_.add(static_cast<std::int64_t>(n));
    mine->add(static_cast<std::int64_t>(n));
    return c10::DataPtr(data, data, &MemoryMeter::release, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &MemoryMeter::release; }
  // Pure virtual from LibTorch 2.3 on, absent before: no `override`, so both compile.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  /// Bytes alive now, and the most alive at once since the last reset_peak().
  std::int64_t current() const { return total_.current.load(); }
  std::int64_t peak() const { return total_.peak.load(); }
  /// The same for what thread `t` allocated (0 for a thread that never allocated).
  std::int64_t current_of(std::thread::id t) const {
    std::lock_guard<std::mutex> lock(threads_mutex_);
    // The newest counter of the thread: an id may be reused once its thread has ended.
    for (auto it = threads_.rbegin(); it != threads_.rend(); ++it) {
      if (it->thread == t) return it->current.load();
    }
    return 0;
  }
  std::int64_t peak_of(std::thread::id t) const {
    std::lock_guard<std::mutex> lock(threads_mutex_);
    for (auto it = threads_.rbegin(); it != threads_.rend(); ++it) {
      if (it->thread == t) return it->peak.load();
    }
    return 0;
  }
  /// One thread's bytes: alive now, and the most alive at once since the last reset_peak().
  struct ThreadBytes {
    std::thread::id thread;
    std::int64_t current = 0;
    std::int64_t peak = 0;
  };
  /// Every thread that allocated, in the order each first did (one that ended keeps its entry).
  ///   for (const auto& t : meter.threads()) std::cout << t.peak << "\n";
  std::vector<ThreadBytes> threads() const {
    std::lock_guard<std::mutex> lock(threads_mutex_);
    std::vector<ThreadBytes> out;
    for (const auto& c : threads_) out.push_back({c.thread, c.current.load(), c.peak.load()});
    return out;
  }
  /// Starts a new peak from what is alive now, in all and for every thread.
  void reset_peak() {
    total_.peak.store(total_.current.load());
    std::lock_guard<std::mutex> lock(threads_mutex_);
    for (auto& c : threads_) c.peak.store(c.current.load());
  }

 private:
  explicit MemoryMeter(c10::Allocator* base) : base_(base) {}

  struct Counter {
    std::thread::id thread;
    std::atomic<std::int64_t> current{0};
    std::atomic<std::int64_t> peak{0};
    void add(std::int64_t delta) {
      const std::int64_t now = current.fetch_add(delta) + delta;
      std::int64_t seen = peak.load();
      while (now > seen && !peak.compare_exchange_weak(seen, now)) {
      }
    }
  };
  struct Entry {
    c10::DataPtr inner;
    std::size_t bytes = 0;
    Counter* owner = nullptr;
  };

  static MemoryMeter*& self() {
    static MemoryMeter* m = nullptr;
    return m;
  }

  // This thread's counter, made on its first allocation; counters live as long as the meter (a
  // deque does not move its elements), so a tensor may outlive the thread that made it.
  Counter* this_thread() const {
    thread_local Counter* mine = nullptr;
    if (mine == nullptr) {
      std::lock_guard<std::mutex> lock(threads_mutex_);
      mine = &threads_.emplace_back();
      mine->thread = std::this_thread::get_id();
    }
    return mine;
  }

  static void release(void* data) {
    MemoryMeter& m = *self();
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(m.mutex_);
      auto it = m.live_.find(data);
      if (it == m.live_.end()) {
        // Allocated by the wrapped allocator before the meter was installed (some kernels keep
        // the allocator they first saw), freed through the meter's raw deleter.
        m.base_->raw_deleter()(data);
        return;
      }
      entry = std::move(it->second);
      m.live_.erase(it);
    }
    m.total_.add(-static_cast<std::int64_t>(entry.bytes));
    entry.owner->add(-static_cast<std::int64_t>(entry.bytes));
    // entry.inner frees the wrapped allocation here, outside the lock
  }

  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Entry> live_;
  mutable Counter total_;
  mutable std::mutex threads_mutex_;
  mutable std::deque<Counter> threads_;
};

}  // namespace stagewise
