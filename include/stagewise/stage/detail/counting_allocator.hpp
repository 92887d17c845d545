#pragma once

#include "stagewise/core/version.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace stagewise::detail {

// A CPU allocator that counts the bytes of tensor memory alive, installed only while a
// `CountCpuBytes` scope lives (balance_by_size). Each allocation is forwarded to the allocator
// that was installed before; its DataPtr waits in a table until the tensor frees it, so memory
// allocated during the scope and freed after it is still returned to its owner.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) STAGEWISE_ALLOCATE_CONST override {
    c10::DataPtr inner = base_.load()->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto [it, fresh] = live_.try_emplace(data);
      if (!fresh) {
        // A stale entry: its memory was freed through the wrapped allocator's raw deleter after
        // the scope ended, and the address came back. Forget it without freeing it again.
        current_ -= static_cast<int64_t>(it->second.bytes);
        (void)it->second.inner.release_context();
      }
      it->second = Entry{std::move(inner), n};
    }
    const int64_t now = current_ += static_cast<int64_t>(n);
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, data, &CountingCpuAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }

  // Pure virtual from LibTorch 2.3 on, absent before: no `override`, so both compile.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  // Bytes allocated through this allocator and not freed yet, and the most at once since the
  // last reset_peak().
  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator* self = new CountingCpuAllocator();  // outlives every tensor
    return *self;
  }

  // Puts this allocator in front of `base` (the allocator LibTorch uses for the CPU now).
  void wrap(c10::Allocator* base) { base_.store(base); }
  c10::Allocator* wrapped() const { return base_.load(); }

 private:
  struct Entry {
    c10::DataPtr inner;
    std::size_t bytes = 0;
  };

  static void release(void* data) {
    CountingCpuAllocator& self = instance();
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.live_.find(data);
      if (it == self.live_.end()) {
        // Allocated by the wrapped allocator, freed through this raw deleter.
        self.base_.load()->raw_deleter()(data);
        return;
      }
      entry = std::move(it->second);
      self.live_.erase(it);
    }
    self.current_ -= static_cast<int64_t>(entry.bytes);
    // entry.inner frees the wrapped allocation here, outside the lock
  }

  std::atomic<c10::Allocator*> base_{nullptr};
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Entry> live_;
  mutable std::atomic<int64_t> current_{0};
  mutable std::atomic<int64_t> peak_{0};
};


// Installs the counting allocator for the CPU for the scope's lifetime, then puts the previous
// allocator back. One scope at a time in a process (balance_by_size takes a lock for it).
class CountCpuBytes {
 public:
  CountCpuBytes() : lock_(mutex()) {
    previous_ = c10::GetAllocator(c10::DeviceType::CPU);
    auto& counting = CountingCpuAllocator::instance();
    if (previous_ != &counting) counting.wrap(previous_);
    c10::SetAllocator(c10::DeviceType::CPU, &counting, /*priority=*/255);
  }
  ~CountCpuBytes() { c10::SetAllocator(c10::DeviceType::CPU, previous_, /*priority=*/255); }
  CountCpuBytes(const CountCpuBytes&) = delete;
  CountCpuBytes& operator=(const CountCpuBytes&) = delete;

  int64_t current() const { return CountingCpuAllocator::instance().current(); }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock_;
  c10::Allocator* previous_ = nullptr;
};

}  // namespace stagewise::detail
