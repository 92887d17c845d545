#pragma once

// The benchmarks' counting allocator: stagewise::MemoryMeter (the library's, installed once),
// read as the benchmarks read it: the bytes of tensor memory alive now and at peak, in all and per
// allocating thread (a pipeline's worker stands for a device: what it allocates is what its
// device would hold, until freed on whichever thread). Take it before the tensors to be measured
// exist.

#include <stagewise/stage/memory_meter.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace stagewise::bench {

class CountingAllocator {
 public:
  explicit CountingAllocator(MemoryMeter& meter) : meter_(meter) {}

  long long current() const { return meter_.current(); }
  long long peak() const { return meter_.peak(); }
  /// Starts a new peak measurement from what is alive now, in all and on every thread.
  void reset_peak() { meter_.reset_peak(); }

  /// Bytes alive now that each thread allocated (one entry per thread that ever allocated, in
  /// the order they first did; a thread that exited keeps its entry).
  std::vector<long long> thread_current() const {
    std::vector<long long> out;
    for (const auto& t : meter_.threads()) out.push_back(t.current);
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
    std::vector<long long> out;
    std::size_t i = 0;
    for (const auto& t : meter_.threads()) {
      out.push_back(t.peak - (i < before.size() ? before[i] : 0));
      ++i;
    }
    return out;
  }

 private:
  MemoryMeter& meter_;
};

/// The process-wide counting allocator (MemoryMeter::install(), on the first call).
inline CountingAllocator& counting_allocator() {
  static CountingAllocator instance(MemoryMeter::install());
  return instance;
}

}  // namespace stagewise::bench
